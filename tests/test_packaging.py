"""The package installs as a regular wheel and imports from outside the repository."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_and_imports_outside_repo(tmp_path):
    wheels = tmp_path / "wheels"
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(ROOT)],
        check=True, cwd=tmp_path,
    )
    (wheel,) = wheels.glob("dtfm-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True, cwd=tmp_path,
    )
    code = (
        "import dtfm, dtfm.scenarios, dtfm.net, dtfm.sched, dtfm.train, dtfm.gossip, dtfm.peer, dtfm.swarm\n"
        "from importlib.resources import files\n"
        "print(dtfm.__file__)\n"
        "print(sorted(p.name for p in files('dtfm.scenarios').iterdir() if p.name.endswith('.toml')))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True).stdout.splitlines()
    assert out[0].startswith(str(target))
    assert out[1] == str(sorted(["datacenter.toml", "regional.toml", "spot.toml",
                                 "universities.toml", "worldwide.toml"]))


def test_every_package_folder_is_in_the_wheel():
    # A package folder missing from pyproject's list is left out of a non-editable install
    # (train/compress was, and `import dtfm.train` failed outside the repository).
    import tomllib
    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"dtfm." + ".".join(p.parent.relative_to(root).parts) if p.parent != root else "dtfm"
             for p in root.rglob("__init__.py")
             if not {".venv", "build", "tests", ".git"} & set(p.relative_to(root).parts)}
    assert found - listed == set(), f"package folders missing from pyproject.toml: {sorted(found - listed)}"
