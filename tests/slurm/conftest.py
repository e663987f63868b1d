"""A real Slurm for these tests (tests/slurmcluster.py): munged, slurmctld and two slurmd on this
machine, started once per module. Without Slurm (or without root, which slurmd needs) the tests skip
with the reason, except under CI=true, where that is a failure: CI must run them (scripts/setup
installs slurm-wlm and munge as root)."""
from __future__ import annotations

import os

import pytest

from tests.slurmcluster import SlurmCluster, missing_programs, start_slurm


def require_slurm() -> None:
    missing = missing_programs()
    reason = None
    if missing:
        reason = f"Slurm is not installed (no {', '.join(missing)}); run scripts/setup as root (slurm-wlm, munge)"
    elif os.geteuid() != 0:
        reason = "slurmd must run as root to start job steps; run these tests as root"
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> SlurmCluster:
    require_slurm()
    try:
        cluster = start_slurm(tmp_path_factory.mktemp("slurm"), nodes=2)
    except Exception as exc:   # e.g. slurmd cannot start in this container
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip(f"Slurm could not be started here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.leftover_pids(), "Slurm daemons left running"
