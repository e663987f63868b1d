"""A cluster probed and benched once for a test module, then given to each test as stored profiles.

Tests that launch the same cluster and are not about the bench need its profiles, not a bench of
their own: each quick bench of a node's emulated devices starts a dozen processes (a synchronous
group, the devices together, the PS exchange) and took 20-40 s of the suite's 2 cores. Launch reuses
stored profiles as a second run of the main command does (docs/bench.md).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def probe_and_bench(cluster_file: Path, state_dir: Path, model: str) -> Path:
    """``hgtrain probe`` and ``bench --quick --model MODEL`` of ``cluster_file`` into ``state_dir``;
    returns its ``clusters`` directory (the inventory and the profiles)."""
    env = {**os.environ, "HGTRAIN_STATE_DIR": str(state_dir)}
    for argv in (["probe"], ["bench", "--quick", "--model", model]):
        done = subprocess.run([sys.executable, "-m", "hgcli", *argv, "-c", str(cluster_file)], env=env,
                              capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr
    return state_dir / "clusters"


def give_stored(clusters: Path, state_dir: Path) -> None:
    """What ``probe_and_bench`` stored, in a test's own state directory."""
    shutil.copytree(clusters, state_dir / "clusters", dirs_exist_ok=True)
