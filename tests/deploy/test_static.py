"""deploy/ checked by the real tools where they exist, and offline checks otherwise.

* promtool (Debian's prometheus package, installed by `make sysdeps`): `check rules`,
  `check config`, `test rules`;
* the Grafana dashboard and alert rules only name metrics qcluster exports
  (qcluster.metrics; the live test in test_prometheus_live.py checks real /metrics);
* Kubernetes manifests: YAML parses, and each document validates against the minimal
  JSON schemas in tests/deploy/schemas.json (required structure of the kinds we ship: not
  the full upstream OpenAPI schema, which is not available offline);
* `systemd-analyze verify` on the units where systemd-analyze exists;
* the Dockerfile: multi-stage and not running as root (no Docker engine here to build it).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import redis
import typer.main
import yaml

from qcluster.broker.amqp_topology import split_queue_type
from qcluster.broker.urls import parse_ha_url
from qcluster.cli import cli, register_commands
from qcluster.client import Client
from qcluster.config import Settings, load_settings
from qcluster.errors import ConfigError
from qcluster.security import check_server_security, parse_listen
from tests.brokers import _die_with_parent, free_port
from tests.conftest import IN_CI, ROOT
from tests.deploy.metric_names import exported_names, names_in

DEPLOY = ROOT / "deploy"
PROM = DEPLOY / "prometheus"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is not installed (make sysdeps installs it)")
        pytest.skip(f"{name} is not installed")
    return path


def run(*args: str, cwd: Path = PROM) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_promtool_checks_rules_config_and_rule_unit_tests() -> None:
    promtool = tool("promtool")
    assert "SUCCESS: 9 rules found" in run(promtool, "check", "rules", "alerts.yml")
    run(promtool, "check", "config", "prometheus.yml")
    # The compose file names alerts.yml as mounted in the container: syntax only.
    run(promtool, "check", "config", "--syntax-only", str(DEPLOY / "compose" / "prometheus.yml"))
    assert "SUCCESS" in run(promtool, "test", "rules", "alerts_test.yml")


def alert_expressions() -> list[str]:
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "qcluster-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


@pytest.mark.parametrize("source", [alert_expressions, dashboard_expressions])
def test_queries_name_only_exported_metrics(source: Any) -> None:
    used = set().union(*(names_in(expr) for expr in source()))
    assert used, "no qcluster metric found in the queries"
    assert used <= exported_names(), f"unknown metrics: {sorted(used - exported_names())}"


def test_dashboard_covers_the_issue_panels() -> None:
    text = " ".join(dashboard_expressions())
    for name in ("qcluster_queue_backlog", "qcluster_queue_locked", "qcluster_jobs_total",
                 "qcluster_queue_load_ratio", "qcluster_queue_slots_planned",
                 "qcluster_queue_slots_current", "qcluster_host_capacity_slots",
                 "qcluster_host_pss_total_bytes", "qcluster_slot_restarts_total",
                 "qcluster_job_wait_seconds_bucket"):
        assert name in text, name


def k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path, doc))
    return docs


def k8s_schemas() -> dict[str, Any]:
    """schemas.json, plus the kinds of the overlays (a StatefulSet and a Job: a Deployment's
    pod template under another kind)."""
    schemas: dict[str, Any] = json.loads((Path(__file__).parent / "schemas.json").read_text())
    stateful_set = copy.deepcopy(schemas["Deployment"])
    stateful_set["properties"]["kind"] = {"const": "StatefulSet"}
    stateful_set["properties"]["spec"]["required"].append("serviceName")
    job = copy.deepcopy(schemas["Deployment"])
    job["properties"]["apiVersion"] = {"const": "batch/v1"}
    job["properties"]["kind"] = {"const": "Job"}
    job["properties"]["spec"]["required"] = ["template"]
    return {**schemas, "StatefulSet": stateful_set, "Job": job}


def test_kubernetes_manifests_parse_and_match_the_schemas() -> None:
    schemas = k8s_schemas()
    kinds = set()
    for path, doc in k8s_documents():
        kind = doc.get("kind")
        assert kind in schemas, f"{path}: no schema for kind {kind!r}"
        jsonschema.validate(doc, schemas[kind])
        kinds.add(kind)
    assert {"Deployment", "DaemonSet", "Service", "ConfigMap", "PodMonitor",
            "Kustomization"} <= kinds


def test_master_daemonset_drains_and_keeps_metrics_in_memory() -> None:
    master = next(d for _, d in k8s_documents() if d["kind"] == "DaemonSet")
    pod = master["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 60  # above graceful_timeout_s
    volume = next(v for v in pod["volumes"] if v["name"] == "metrics-dir")
    assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_no_shipped_file_carries_a_token_and_the_roles_need_one() -> None:
    """The shipped files listened on 0.0.0.0 with the token `change-me`, which the manager
    accepted: anyone reaching port 7300 could steer the cluster. Now the token comes from a
    Secret / environment variable the user must set, and a placeholder is refused."""
    assert not any(doc.get("kind") == "Secret" for _, doc in k8s_documents())
    for _, doc in k8s_documents():
        if doc.get("kind") in ("Deployment", "DaemonSet"):
            env = {e["name"]: e for e in doc["spec"]["template"]["spec"]["containers"][0]["env"]}
            ref = env["QCLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "qcluster-token" and not ref.get("optional")
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    token = compose["x-qcluster"]["environment"]["QCLUSTER_TOKEN"]
    assert token.startswith("${QCLUSTER_TOKEN:?"), token  # compose stops when it is unset
    env_example = (DEPLOY / "systemd" / "qcluster.env.example").read_text()
    assert "QCLUSTER_TOKEN=\n" in env_example
    for text in (env_example, (DEPLOY / "compose" / "compose.yaml").read_text(),
                 *(path.read_text() for path in (DEPLOY / "k8s").rglob("*.yaml"))):
        assert "token: change-me" not in text and "TOKEN: change-me" not in text


@pytest.mark.parametrize("placeholder", ["change-me", "", None])
def test_the_shipped_listen_addresses_refuse_a_placeholder_token(placeholder: str | None) -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    command = compose["services"]["manager"]["command"]
    listen = parse_listen(command[command.index("--listen") + 1])
    assert not listen.loopback
    with pytest.raises(ConfigError):
        check_server_security(listen, placeholder, role="manager")


def test_kustomize_resources_exist() -> None:
    for kustomization in (DEPLOY / "k8s").rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        for entry in spec.get("resources", []) + [p["path"] for p in spec.get("patches", [])]:
            assert (kustomization.parent / entry).exists(), f"{kustomization}: {entry} missing"


def test_compose_file_has_the_whole_stack() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    assert {"redis", "rabbitmq", "manager", "master-a", "master-b", "prometheus",
            "grafana"} <= set(compose["services"])


def test_systemd_units_verify() -> None:
    units = sorted((DEPLOY / "systemd").glob("*.service"))
    for unit in units:
        text = unit.read_text()
        assert "Restart=" in text and "EnvironmentFile=" in text
    master = (DEPLOY / "systemd" / "qcluster-master.service").read_text()
    assert "RuntimeDirectory=" in master and "TimeoutStopSec=90" in master
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze on this machine: only the unit text was checked")
    done = subprocess.run([analyze, "verify", *map(str, units)], capture_output=True, text=True)
    # Missing /opt/qcluster/bin/qcluster on a dev machine is expected; syntax errors are not.
    errors = [line for line in done.stderr.splitlines() if "Unknown" in line or "bad" in line]
    assert not errors, done.stderr


def test_dockerfile_is_multistage_and_unprivileged() -> None:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    stages = [line for line in lines if line.startswith("FROM ")]
    users = [line for line in lines if line.startswith("USER ")]
    assert len(stages) >= 2
    assert users and users[-1].split()[1] not in ("root", "0")


# --- Redis Cluster and RabbitMQ quorum examples (issue 17 item 7) ----------------------------

COMPOSE = DEPLOY / "compose"
OVERLAYS = DEPLOY / "k8s" / "overlays"
COMPOSE_OVERRIDES = ("compose.redis-cluster.yaml", "compose.rabbitmq-quorum.yaml")
#: Environment variables a user sets for the examples (never a value in the files).
SECRET_VARS = ("QCLUSTER_REDIS_PASSWORD", "QCLUSTER_RABBITMQ_PASSWORD", "QCLUSTER_RABBITMQ_COOKIE",
               "QCLUSTER_TOKEN")


def compose_file(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((COMPOSE / name).read_text())
    return loaded


def _depends(service: dict[str, Any]) -> dict[str, Any]:
    depends = service.get("depends_on", {})
    return {name: {} for name in depends} if isinstance(depends, list) else dict(depends)


def merged_services(override: str) -> dict[str, dict[str, Any]]:
    """compose.yaml with ``override`` on top, by compose's merge rules for the keys the
    examples use: mappings (environment, depends_on) merge, other keys are replaced."""
    services = copy.deepcopy(compose_file("compose.yaml")["services"])
    for name, extra in compose_file(override)["services"].items():
        service = services.setdefault(name, {})
        for key, value in extra.items():
            if key == "environment":
                service[key] = {**service.get(key, {}), **value}
            elif key == "depends_on":
                service[key] = {**_depends(service), **_depends(extra)}
            else:
                service[key] = value
    return services


def with_secrets(text: str) -> str:
    """``text`` as compose would expand it with every SECRET_VARS set to a sample value."""
    for name in SECRET_VARS:
        text = re.sub(r"\$\{" + name + r"(:\?[^}]*)?\}", "s3cr3t", text)
    return text


def qcluster_options(command: str) -> set[str]:
    """The options ``qcluster COMMAND`` shows in --help (from the CLI itself, roles included):
    a hidden option is kept for old command lines only."""
    register_commands()
    group: Any = typer.main.get_command(cli)  # a click group (typer may vendor click)
    found = group.commands.get(command)
    assert found is not None, f"qcluster has no command {command!r}"
    return {option for param in found.params if not getattr(param, "hidden", False)
            for option in (*param.opts, *param.secondary_opts) if option.startswith("-")}


def test_compose_overrides_reference_services_images_and_files_that_exist() -> None:
    base = compose_file("compose.yaml")["services"]
    for override in COMPOSE_OVERRIDES:
        spec = compose_file(override)
        services = merged_services(override)
        for name, service in spec["services"].items():
            # A new service brings its image; an existing one is only amended.
            assert name in base or service.get("image"), f"{override}: {name} has no image"
            for mount in service.get("volumes", []):
                source = mount.split(":")[0]
                if source.startswith("."):
                    assert (COMPOSE / source).is_file(), f"{override}: {source} missing"
                else:
                    assert source in spec.get("volumes", {}), f"{override}: volume {source}?"
        for name, service in services.items():
            for needed in _depends(service):
                assert needed in services, f"{override}: {name} depends on unknown {needed}"


def test_compose_overrides_run_qcluster_with_existing_options() -> None:
    for override in ("compose.yaml", *COMPOSE_OVERRIDES):
        for name, service in merged_services(override).items():
            if service.get("image") != "qcluster:0.1.0":
                continue
            command = service["command"]
            unknown = {arg for arg in command if arg.startswith("-")} - qcluster_options(command[0])
            assert not unknown, f"{override}: {name}: unknown options {sorted(unknown)}"


def test_kubernetes_manifests_run_qcluster_with_existing_options() -> None:
    for path, doc in k8s_documents():
        if doc["kind"] not in ("Deployment", "DaemonSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if container["image"].startswith("qcluster:"):
                args = container["args"]
                unknown = {arg for arg in args if arg.startswith("-")} - qcluster_options(args[0])
                assert not unknown, f"{path}: unknown options {sorted(unknown)}"


def test_systemd_units_run_qcluster_with_existing_options() -> None:
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        starts = [line.split("=", 1)[1].split() for line in unit.read_text().splitlines()
                  if line.startswith("ExecStart=")]
        assert starts, unit
        for program, command, *args in starts:
            assert program.endswith("/qcluster"), unit
            unknown = {arg for arg in args if arg.startswith("-")} - qcluster_options(command)
            assert not unknown, f"{unit.name}: unknown options {sorted(unknown)}"


def test_qcluster_environment_variables_are_settings() -> None:
    """A misspelt QCLUSTER_* name would be ignored, not refused: every one is a setting."""
    known = {f"QCLUSTER_{field.upper()}" for field in Settings.model_fields}
    names = set()
    for override in ("compose.yaml", *COMPOSE_OVERRIDES):
        for service in merged_services(override).values():
            names |= set(service.get("environment", {}))
    for _, doc in k8s_documents():
        if doc["kind"] in ("Deployment", "DaemonSet"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                names |= {env["name"] for env in container.get("env", [])}
    used = {name for name in names if name.startswith("QCLUSTER_")}
    assert {"QCLUSTER_BROKER_URL", "QCLUSTER_TOKEN"} <= used
    assert used <= known, f"not settings: {sorted(used - known)}"


def test_redis_cluster_compose_example_points_qcluster_at_its_nodes() -> None:
    services = merged_services("compose.redis-cluster.yaml")
    nodes = sorted(name for name in services if name.startswith("redis-node-"))
    assert len(nodes) == 6  # 3 masters + 3 replicas
    create = services["redis-cluster-create"]
    assert create["command"][2:] == nodes
    assert {needed: {"condition": "service_healthy"} for needed in nodes} == create["depends_on"]
    for role in ("manager", "master-a", "master-b"):
        service = services[role]
        assert service["depends_on"]["redis-cluster-create"] == {
            "condition": "service_completed_successfully"}
        url = parse_ha_url(with_secrets(service["environment"]["QCLUSTER_BROKER_URL"]))
        assert url.kind == "redis-cluster" and url.replicas == 1 and url.password == "s3cr3t"
        assert {host for host, _ in url.hosts} <= set(nodes)


def test_the_cluster_script_is_the_same_for_compose_and_kubernetes() -> None:
    script = OVERLAYS / "redis-cluster" / "create-cluster.sh"
    compose = (COMPOSE / "compose.redis-cluster.yaml").read_text()
    assert "../k8s/overlays/redis-cluster/create-cluster.sh:/create-cluster.sh:ro" in compose
    done = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # The password reaches redis-cli through REDISCLI_AUTH, never on a command line.
    assert " -a " not in script.read_text()


def redis_node_scripts() -> list[str]:
    """The shell script each Redis Cluster node runs (compose and the StatefulSet: both are
    `sh -c SCRIPT`), with `$$` (compose's and Kubernetes' escape) back to `$`."""
    commands = [service["command"]
                for name, service in compose_file("compose.redis-cluster.yaml")["services"].items()
                if name.startswith("redis-node-")]
    stateful_set = next(doc for _, doc in k8s_documents() if doc["kind"] == "StatefulSet")
    container = stateful_set["spec"]["template"]["spec"]["containers"][0]
    commands.append(container["command"] + container["args"])
    assert all(command[:2] == ["sh", "-c"] and len(command) == 3 for command in commands)
    return [command[2].replace("$$", "$") for command in commands]


@pytest.mark.parametrize("setting", ["--cluster-enabled yes", "--appendonly yes",
                                     "--maxmemory-policy noeviction", "--requirepass",
                                     "--masterauth", "--cluster-announce-hostname"])
def test_every_redis_cluster_node_has_the_settings_qcluster_needs(setting: str) -> None:
    """docs/operations.md: AOF on every node, noeviction on every master (qcluster refuses an
    evicting one), requirepass and masterauth, and stable names in redirections."""
    for script in redis_node_scripts():
        assert setting in script, script


def test_the_redis_node_scripts_start_redis_with_those_settings(tmp_path: Path) -> None:
    """Each node's script, run by sh with Debian's redis-server (on a free loopback port),
    starts a server that has the settings: a misspelt option would stop it."""
    assert shutil.which("redis-server"), "no redis-server (make sysdeps installs it)"
    for number, script in enumerate(set(redis_node_scripts())):
        port, directory = free_port(), tmp_path / str(number)
        directory.mkdir()
        script = script.replace("/data/nodes.conf", "nodes.conf")
        # The bus port is port + 10000 unless given: out of range for a high free port.
        script += (f" --port {port} --cluster-port {free_port()} --bind 127.0.0.1"
                   f" --dir {directory}")
        env = {**os.environ, "REDISCLI_AUTH": "s3cr3t"}
        server = subprocess.Popen(["sh", "-c", script], env=env, cwd=directory,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  preexec_fn=_die_with_parent)
        try:
            config = _config_once_up(server, port)
        finally:
            server.terminate()
            server.wait(timeout=60)
        assert config["appendonly"] == "yes" and config["maxmemory-policy"] == "noeviction"
        assert config["cluster-enabled"] == "yes" and config["masterauth"] == "s3cr3t"
        assert config["cluster-preferred-endpoint-type"] == "hostname"


def test_the_cluster_script_creates_a_cluster_qcluster_publishes_to_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six nodes run by the compose node script (announcing 127.0.0.1: this machine's host
    name may not resolve), then create-cluster.sh as the one-shot service runs it: qcluster
    publishes with replicas=1 once it exits, and a second run finds the cluster and changes
    nothing."""
    assert shutil.which("redis-server"), "no redis-server (make sysdeps installs it)"
    script = redis_node_scripts()[0].replace('"$(hostname)"', "127.0.0.1")
    env = {name: value for name, value in os.environ.items() if not name.startswith("QCLUSTER_")}
    env["REDISCLI_AUTH"] = "s3cr3t"
    nodes: list[tuple[int, subprocess.Popen[bytes]]] = []
    try:
        for number in range(6):
            port, directory = free_port(), tmp_path / f"node-{number}"
            directory.mkdir()
            # No 5 s wait before a replica's first full sync (the default delay): speed only.
            command = (f"{script} --port {port} --cluster-port {free_port()} "
                       f"--bind 127.0.0.1 --dir {directory} --repl-diskless-sync-delay 0")
            nodes.append((port, subprocess.Popen(["sh", "-c", command], env=env, cwd=directory,
                                                 stdout=subprocess.DEVNULL,
                                                 preexec_fn=_die_with_parent)))
        create = ["sh", str(OVERLAYS / "redis-cluster" / "create-cluster.sh"),
                  *(f"127.0.0.1:{port}" for port, _ in nodes)]
        first = subprocess.run(create, env=env, capture_output=True, text=True, timeout=600)
        assert first.returncode == 0 and "cluster created" in first.stdout, first.stdout
        url = ("redis+cluster://:s3cr3t@" + ",".join(f"127.0.0.1:{port}" for port, _ in nodes)
               + "?replicas=1")
        queues = [f"deploy-check-{n}" for n in range(6)]  # spread over the shards by name
        monkeypatch.chdir(tmp_path)  # no qcluster.toml, no QCLUSTER_* variable
        for name in [name for name in os.environ if name.startswith("QCLUSTER_")]:
            monkeypatch.delenv(name)
        with Client(url) as client:
            for queue in queues:
                client.enqueue(queue, {"n": 1})
            assert {queue: client.stats(queue)["ready"] for queue in queues} == dict.fromkeys(
                queues, 1)
        again = subprocess.run(create, env=env, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0 and "the cluster exists" in again.stdout, again.stdout
    finally:
        for _, server in nodes:
            server.terminate()
        for _, server in nodes:
            server.wait(timeout=60)


def _config_once_up(server: subprocess.Popen[bytes], port: int) -> dict[str, str]:
    client = redis.Redis(port=port, password="s3cr3t", decode_responses=True)
    deadline = time.monotonic() + 60
    while True:
        assert server.poll() is None, (server.stdout.read() if server.stdout else b"").decode()
        try:
            return {str(key): str(value) for key, value in client.config_get("*").items()}
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not answer within 60 s"
            time.sleep(0.1)
        finally:
            client.close()


def test_kubernetes_redis_cluster_job_names_every_node() -> None:
    docs = [doc for path, doc in k8s_documents() if "redis-cluster" in path.parts]
    stateful_set = next(doc for doc in docs if doc["kind"] == "StatefulSet")
    service = next(doc for doc in docs if doc["kind"] == "Service")
    job = next(doc for doc in docs if doc["kind"] == "Job")
    name, count = stateful_set["metadata"]["name"], stateful_set["spec"]["replicas"]
    assert stateful_set["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == [f"{name}-{i}.{service['metadata']['name']}" for i in range(count)]
    replicas = int(next(e["value"] for e in container["env"] if e["name"] == "REPLICAS"))
    assert count % (replicas + 1) == 0 and count // (replicas + 1) >= 3
    for pod in (stateful_set, job):
        env = pod["spec"]["template"]["spec"]["containers"][0]["env"]
        auth = next(e for e in env if e["name"] == "REDISCLI_AUTH")
        assert auth["valueFrom"]["secretKeyRef"]["name"] == "redis-cluster-auth"
    kustomization = yaml.safe_load((OVERLAYS / "redis-cluster" / "kustomization.yaml").read_text())
    script = kustomization["configMapGenerator"][0]
    assert script["name"] == job["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]


def test_rabbitmq_quorum_compose_example_declares_quorum_queues_on_its_nodes() -> None:
    services = merged_services("compose.rabbitmq-quorum.yaml")
    conf = (COMPOSE / "rabbitmq-quorum" / "rabbitmq.conf").read_text()
    nodes = [services[name]["hostname"] for name in ("rabbitmq", "rabbitmq-2", "rabbitmq-3")]
    assert all(f"= rabbit@{node}\n" in conf for node in nodes)
    for role in ("manager", "master-a", "master-b"):
        url = with_secrets(services[role]["environment"]["QCLUSTER_BROKER_URL"])
        plain, queue_type = split_queue_type(url)
        assert queue_type == "quorum"
        assert [urlsplit(one).hostname for one in plain.split(";")] == nodes
        assert all(urlsplit(one).password == "s3cr3t" for one in plain.split(";"))
        assert set(services[role]["depends_on"]) >= {"rabbitmq", "rabbitmq-2", "rabbitmq-3"}
    for name in ("rabbitmq", "rabbitmq-2", "rabbitmq-3"):
        env = services[name]["environment"]
        assert env["RABBITMQ_DEFAULT_PASS"].startswith("${QCLUSTER_RABBITMQ_PASSWORD:?")
        assert env["RABBITMQ_ERLANG_COOKIE"].startswith("${QCLUSTER_RABBITMQ_COOKIE:?")


def test_no_example_ships_a_password() -> None:
    """Every secret of the examples is a variable compose refuses to run without, or a
    Kubernetes Secret the user creates."""
    for override in COMPOSE_OVERRIDES:
        text = (COMPOSE / override).read_text()
        for name in SECRET_VARS:
            assert re.search(r"\$\{" + name + r"\}", text) is None or "${" + name + ":?" in text
        assert not re.search(r"(PASS|AUTH|COOKIE)\w*: (?!\$\{)", text), override
    assert not any(doc["kind"] == "Secret" for _, doc in k8s_documents())


def test_the_quorum_overlay_is_the_base_configuration_with_quorum_queues(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("QCLUSTER_"):
            monkeypatch.delenv(name)
    base = yaml.safe_load((DEPLOY / "k8s" / "base" / "configmap.yaml").read_text())
    overlay = OVERLAYS / "rabbitmq-quorum" / "qcluster.toml"
    assert tomllib.loads(overlay.read_text()) == {
        **tomllib.loads(base["data"]["qcluster.toml"]), "queue_type": "quorum"}
    settings = load_settings(overlay, broker_url="amqp://qcluster:s3cr3t@rabbitmq-0:5672//")
    assert split_queue_type(settings.broker_url or "")[1] == "quorum"
    overlay_dir = OVERLAYS / "rabbitmq-quorum"
    kustomization = yaml.safe_load((overlay_dir / "kustomization.yaml").read_text())
    generator = kustomization["configMapGenerator"][0]
    assert generator == {"name": base["metadata"]["name"], "behavior": "replace",
                         "files": ["qcluster.toml"]}


def test_deploy_paths_named_in_the_docs_exist() -> None:
    for doc in (ROOT / "README.md", ROOT / "docs" / "operations.md"):
        named = {path.rstrip(".,") for path in
                 re.findall(r"(?<![\w/])deploy/[\w./-]+", doc.read_text())}
        named = {path for path in named if "NAME" not in path}  # a placeholder
        assert "deploy/k8s/overlays/redis-cluster" in named, doc
        missing = sorted(path for path in named if not (ROOT / path).exists())
        assert not missing, f"{doc.name} names {missing}"
