"""The layer rules (`.importlinter`) hold: import-linter's own checker, run on the installed layout
(kernels/ and rollout/ sit at the top of the repository but install as beam_rl.kernels and
beam_rl.rollout, which is where the rules name them)."""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def installed_layout(dest: Path) -> Path:
    """Copy the source tree into `dest` as setuptools installs it (pyproject's package-dir)."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "beam_rl", dest / "beam_rl", ignore=ignore)
    for package, source in package_dir.items():
        shutil.copytree(ROOT / source, dest.joinpath(*package.split(".")), ignore=ignore)
    return dest


def test_import_linter_contracts(tmp_path):
    pytest.importorskip("importlinter")
    layout = installed_layout(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(layout)}
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter"), "--no-cache"], cwd=layout, env=env,
                          capture_output=True, text=True, timeout=300)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "5 kept, 0 broken" in proc.stdout


def test_every_package_is_installed():
    """Every folder with an __init__.py is in pyproject's package list (else a wheel silently lacks it)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    sources = {"beam_rl": ROOT / "beam_rl", **{pkg: ROOT / src for pkg, src in setuptools["package-dir"].items()}}
    found = set()
    for package, source in sources.items():
        for init in source.rglob("__init__.py"):
            rel = init.parent.relative_to(source).parts
            if "__pycache__" not in rel:
                found.add(".".join((package, *rel)))
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
