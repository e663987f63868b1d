"""`hgtrain plan` end to end over the stored inventory and profiles of the embedded local cluster.

Fresh stored inputs are reused as they are (tests/ops/test_pipeline.py covers probing and benching
when they are missing or stale)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from hgcli import state
from hgcli.cli import main
from hgcli.config.cluster import default_cluster
from hgcli.schema.stages import Plan, Role, Strategy, from_dict, to_dict
from hgcli.plan.files import load_plan
from tests.unit.plan_clusters import A100, T4, cluster
from tests.strictjson import loads as strict_json


def store(inventory: bool = True, profiles: bool = True, nproc_per_node: int | None = None) -> Path:
    """Write the 2 x A100 + 2 x T4 example (or ``nproc_per_node`` A100s) as this machine's stored
    probe and bench results."""
    fingerprint = default_cluster(nproc_per_node).fingerprint()
    kinds = [A100] * nproc_per_node if nproc_per_node else [A100, A100, T4, T4]
    inv, prof = cluster([kinds], fingerprint=fingerprint, names=["local"])
    folder = state.cluster_dir(fingerprint)
    if inventory:
        state.write_json(folder / "inventory.json", to_dict(replace(inv, probed_at=time.time())))
    if profiles:
        state.write_json(folder / "profiles.json", to_dict(prof))
    return folder


def test_json_output_is_the_plan_and_only_json(capsys):
    store()
    assert main(["plan", "--json", "--global-batch", "256"]) == 0
    out = capsys.readouterr().out
    plan = from_dict(Plan, strict_json(out))
    assert plan.cluster == default_cluster().fingerprint()
    assert plan.strategy is Strategy.ALLREDUCE and plan.global_batch == 256
    assert [r.node for r in plan.ranks] == ["local"] * 4 and all(r.emulated for r in plan.ranks)


def test_output_file_is_written_and_loads_back(tmp_path, capsys):
    store()
    path = tmp_path / "plan.json"
    assert main(["plan", "--strategy", "hybrid", "--ps", "1", "--staleness", "3", "-o", str(path)]) == 0
    plan = load_plan(path, default_cluster())
    assert plan.strategy is Strategy.HYBRID and plan.staleness_bound == 3
    assert [r.role for r in plan.ranks].count(Role.PS) == 1
    assert path.stat().st_mode & 0o777 == 0o644
    assert "hybrid (chosen)" in capsys.readouterr().out


def test_human_output_shows_tree_table_and_reason(capsys):
    store()
    assert main(["plan", "--global-batch", "128"]) == 0
    out = capsys.readouterr().out
    for text in ("local", "gpu3", "rank 3", "batch", "EMULATED", "allreduce (chosen)", "ideal", "why:"):
        assert text in out


def test_nproc_per_node_plans_that_many_ranks_of_the_embedded_cluster(capsys, tmp_path):
    store(nproc_per_node=2)
    assert main(["plan", "--json", "--nproc-per-node", "2", "--strategy", "allreduce"]) == 0
    plan = from_dict(Plan, strict_json(capsys.readouterr().out))
    assert plan.world_size == 2 and plan.cluster == default_cluster(2).fingerprint()
    (tmp_path / "c.toml").write_text('[[nodes]]\nhost = "localhost"\n')
    assert main(["plan", "-c", str(tmp_path / "c.toml"), "--nproc-per-node", "2"]) == 2
    assert "--nproc-per-node sizes the embedded local cluster and a Slurm allocation's nodes only" in capsys.readouterr().err


def test_model_size_flag_reaches_the_plan(capsys):
    store()
    assert main(["plan", "--json", "--params", "5000000"]) == 0
    assert strict_json(capsys.readouterr().out)["model"]["parameters"] == 5_000_000


def test_too_big_global_batch_is_one_line_and_exit_2(capsys):
    store()
    assert main(["plan", "--global-batch", "1000000"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    *stages, error = captured.err.strip().splitlines()     # the stage lines, then the one-line error
    assert "does not fit in device memory" in error and error.startswith("hgtrain: error:")
    assert [line.split()[0] for line in stages] == ["probe", "bench", "plan"]


def test_plan_does_not_import_torch():
    store()
    code = ("import sys; from hgcli.cli import main; rc = main(['plan', '--json']); "
            "print('torch' in sys.modules, rc, file=sys.stderr)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}   # this checkout
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stderr.strip().endswith("False 0")
    strict_json(done.stdout)
