"""What ``pip install qcluster`` puts into site-packages: only ``qcluster`` (issue 18).

The role folders stay at the top of the repository and are installed inside the package
(``qcluster.manager``, ``qcluster.slot``, ...). This builds the wheel from a copy of the
sources, installs it into a fresh virtual environment next to a user project that has its
own ``manager`` and ``slot`` packages, and runs a real slot there on the embedded broker:
the job's handler imports the user's ``manager`` and ``slot``, not ours.

No network: the wheel's build requirements come from the machine's configured index (as
for ``make venv``), the fresh environment installs the wheel with ``--no-deps`` and
reaches the dependencies already installed beside this interpreter through a ``.pth``
line (which adds a path and runs none of that directory's own ``.pth`` files, so the
repository's editable install stays out of the way).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from qcluster.broker.embedded import stop_embedded

ROOT = Path(__file__).resolve().parents[1]
ROLES = sorted(p.name for p in (ROOT / "qcluster").iterdir() if p.is_symlink() and p.is_dir())

USER_APP = '''
from pathlib import Path

import manager
import slot
from qcluster import App

app = App("user")


@app.job_queue("work")
def work(job):
    with Path(job.payload["out"]).open("a") as file:
        file.write(f"{manager.WHO} {slot.WHO} {job.payload['n']}\\n")
'''


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the sources (the build leaves no files behind)."""
    base = tmp_path_factory.mktemp("build")
    source = base / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "qcluster", source / "qcluster", symlinks=True, ignore=ignore)
    for role in ROLES:
        shutil.copytree(ROOT / role, source / role, ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
         str(base / "dist"), str(source)],
        check=True, timeout=240, capture_output=True,
    )
    [built] = (base / "dist").glob("qcluster-*.whl")
    return built


def test_the_wheel_holds_only_the_qcluster_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [info] = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert {name.split("/")[0] for name in names} == {"qcluster", info}
    for module in ("qcluster/cli.py", "qcluster/slot/runtime.py", "qcluster/master/cli.py",
                   "qcluster/manager/api/app.py", "qcluster/manager/simulator/engine.py",
                   "qcluster/admin_ui/router.py", "qcluster/demo/launcher.py"):
        assert module in names
    sources = {f"qcluster/{p.relative_to(ROOT / 'qcluster')}"
               for p in (ROOT / "qcluster").glob("**/*.py") if "__pycache__" not in p.parts}
    sources |= {f"qcluster/{p.relative_to(ROOT)}"
                for role in ROLES for p in (ROOT / role).glob("**/*.py")
                if "__pycache__" not in p.parts}
    assert sources - set(names) == set(), "modules missing from the wheel (pyproject packages)"
    assert any(n.startswith("qcluster/admin_ui/templates/") for n in names)
    assert any(n.startswith("qcluster/admin_ui/static/") for n in names)
    assert any(n.startswith("qcluster/broker/lua/") for n in names)
    for command in ("master", "manager", "slot", "simulate", "demo"):
        assert f"\n{command} = qcluster." in entry_points


def test_an_installed_slot_runs_beside_a_users_own_manager_and_slot_packages(
    wheel: Path, tmp_path: Path
) -> None:
    fresh = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(fresh)
    python = fresh / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-index", str(wheel)],
        check=True, timeout=120, capture_output=True,
    )
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_qcluster_test_dependencies.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")

    project = tmp_path / "project"
    for package in ("manager", "slot"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text(f"WHO = 'user-{package}'\n")
    (project / "userapp.py").write_text(USER_APP)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("QCLUSTER_", "PYTHON", "PROMETHEUS_"))}
    state = tmp_path / "state"
    out = tmp_path / "out.txt"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), cwd=project, env=env, capture_output=True,
                              text=True, timeout=120)

    where = run(str(python), "-c", "import json, manager, qcluster, qcluster.manager, slot; "
                "print(json.dumps([m.__file__ for m in (qcluster, qcluster.manager, manager, "
                "slot)]))")
    assert where.returncode == 0, where.stderr
    ours, our_manager, users_manager, users_slot = map(Path, json.loads(where.stdout))
    assert ours.is_relative_to(site) and our_manager.is_relative_to(site)
    assert users_manager == project / "manager" / "__init__.py"
    assert users_slot == project / "slot" / "__init__.py"

    qcluster = str(fresh / "bin" / "qcluster")
    broker = f"embedded://{state}"
    try:
        jobs = tmp_path / "jobs.jsonl"
        jobs.write_text("".join(json.dumps({"n": n, "out": str(out)}) + "\n" for n in (1, 2, 3)))
        enqueued = run(qcluster, "enqueue", "work", "--file", str(jobs), "--broker", broker)
        assert enqueued.returncode == 0, enqueued.stderr
        slot = run(qcluster, "slot", "--queue", "work", "--app", "userapp", "--burst",
                   "--broker", broker)
        assert slot.returncode == 0, slot.stderr
    finally:
        stop_embedded(state)
    assert sorted(out.read_text().splitlines()) == [
        f"user-manager user-slot {n}" for n in (1, 2, 3)]
    usage = run(qcluster, "--help")
    for command in ("enqueue", "master", "manager", "slot", "simulate", "demo"):
        assert f" {command} " in usage.stdout
