"""Real virtual environments for tests of what a node's Python can run.

``python_without(root, "numpy")``: a venv (``python -m venv --without-pip``, about a second) whose
site-packages holds links to everything of this test run's site-packages (torch, hgtrain's
dependencies, the editable hgcli) except the named packages: a Python that really cannot import
numpy but has everything else, without installing anything.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def python_without(root: Path, *packages: str) -> Path:
    """The python of a new venv at ``root`` with this run's packages except ``packages``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    here = Path(torch.__file__).resolve().parents[1]      # the site-packages torch came from
    there = site_packages(root)
    for entry in here.iterdir():
        if not any(entry.name == p or entry.name.startswith((f"{p}-", f"{p}.")) for p in packages):
            (there / entry.name).symlink_to(entry)
    return root / "bin" / "python"


def add_package(python: Path, package: str) -> None:
    """Link ``package`` (and its install metadata) into the venv of ``python``, as installing it would."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin is not None, package
    here = Path(spec.origin).resolve().parents[1]
    there = site_packages(python.parents[1])
    for entry in here.iterdir():
        if entry.name == package or entry.name.startswith((f"{package}-", f"{package}.")):
            (there / entry.name).symlink_to(entry)
