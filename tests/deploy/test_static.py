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

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from qcluster.errors import ConfigError
from qcluster.security import check_server_security, parse_listen
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
    assert "SUCCESS: 8 rules found" in run(promtool, "check", "rules", "alerts.yml")
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


def test_kubernetes_manifests_parse_and_match_the_schemas() -> None:
    schemas = json.loads((Path(__file__).parent / "schemas.json").read_text())
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
