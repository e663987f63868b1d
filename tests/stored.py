"""A cluster probed and benched once (per test module or session), then given to each test that
needs it as stored profiles.

Tests that launch the same cluster and are not about the bench need its profiles, not a bench of
their own: each quick bench of a node's emulated devices starts a dozen processes (a synchronous
group, the devices together, the PS exchange) and took 20-60 s of the suite's 2 cores. Launch reuses
stored profiles as a second run of the main command does (docs/bench.md).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Benched:
    """What ``probe_and_bench`` stored (``clusters``: the inventory and the profiles) and what the
    bench printed."""

    clusters: Path
    stdout: str
    stderr: str


def probe_and_bench(cluster_file: Path | None, state_dir: Path, *bench_args: str) -> Benched:
    """``hgtrain probe`` and ``bench --quick BENCH_ARGS...`` of ``cluster_file`` (None: the embedded
    cluster) into ``state_dir``; both must succeed."""
    env = {**os.environ, "HGTRAIN_STATE_DIR": str(state_dir)}
    where = ["-c", str(cluster_file)] if cluster_file else []
    done = None
    for argv in (["probe"], ["bench", "--quick", *bench_args]):
        done = subprocess.run([sys.executable, "-m", "hgcli", *argv, *where], env=env, capture_output=True,
                              text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr
    assert done is not None
    return Benched(clusters=state_dir / "clusters", stdout=done.stdout, stderr=done.stderr)


def give_stored(benched: Benched, state_dir: Path) -> None:
    """What ``probe_and_bench`` stored, in a test's own state directory."""
    shutil.copytree(benched.clusters, state_dir / "clusters", dirs_exist_ok=True)
