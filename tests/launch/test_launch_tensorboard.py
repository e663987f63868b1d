"""`hgtrain launch --tensorboard DIR`: event files written while the job runs (each rank waits until
its own throughput is in them before it exits), the same scalars `hgtrain metrics --format
tensorboard` writes afterwards; refused with --detach and, without the package, in one line naming
the pip command before anything starts."""
from __future__ import annotations

import sys

import pytest

from hgcli.cli import main
from tests.unit.test_metrics_views import read_runs

from .hg import cluster_toml
from .plans import local_cluster, make_plan, plan_file

PY = sys.executable

RANK = r"""
import glob, json, os, sys, time
fd, rank = int(os.environ['HGTRAIN_METRICS_FD']), int(os.environ['RANK'])
def log(**fields):
    os.write(fd, json.dumps(fields).encode() + b'\n')
for step in range(3):
    log(step=step, loss=1.0 / (step + 1), samples=16, time=1000.0 + step)
if rank == 0:
    log(event='eval', step=2, accuracy=0.5, time=1002.5)
files = os.path.join(sys.argv[1], os.environ['HGTRAIN_JOB_ID'], f'rank{rank}', 'events.out.tfevents.*')
deadline = time.time() + 60
while not any(b'throughput/samples_per_s' in open(f, 'rb').read() for f in glob.glob(files)):
    if time.time() > deadline:
        sys.exit(3)
    time.sleep(0.1)
print('seen live')
"""


def test_launch_writes_event_files_live_and_metrics_writes_the_same(hg, tmp_path, capsys):
    cluster = local_cluster(("a", "b"))
    plan = make_plan(cluster, (("a", "a"), ("b",)), predicted=48.0)
    ctoml, pfile = cluster_toml(tmp_path / "cluster.toml", cluster), plan_file(tmp_path, plan)
    live, after = tmp_path / "tb-live", tmp_path / "tb-after"
    args = ["-c", str(ctoml), "--plan", str(pfile), "--tensorboard", str(live), "--json", "--", PY, "-c", RANK,
            str(live)]

    code, _, err = hg.run("--detach", *args)
    assert code == 2 and "--tensorboard" in err and "--detach" in err
    blocker = tmp_path / "blocker"
    (blocker / "tensorboard").mkdir(parents=True)
    (blocker / "tensorboard" / "__init__.py").write_text("raise ImportError('not installed')\n")
    code, _, err = hg.run(*args, env=hg.env(PYTHONPATH=f"{blocker}:{hg.env()['PYTHONPATH']}"))
    assert code == 2 and err.strip().count("\n") == 0 and "pip install 'hgtrain[tensorboard]'" in err
    assert hg.job_ids() == [] and not live.exists()

    code, out, err = hg.run(*args)
    assert code == 0, err
    assert out.count('"line": "seen live"') == 3
    [job_id] = hg.job_ids()
    runs = read_runs(live / job_id)
    assert set(runs) == {"rank0", "rank1", "rank2", "group0", "group1", "job"}
    assert runs["group0"]["throughput/samples_per_s"] == [(1, 32.0), (2, 32.0)]
    assert runs["group0"]["throughput/predicted"] == [(1, 32.0), (2, 32.0)]   # 48 split 32:16 by batch
    assert runs["group1"]["loss"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]   # float32
    assert runs["job"]["accuracy/eval"] == [(2, 0.5)]
    assert main(["metrics", job_id, "--format", "tensorboard", "-o", str(after)]) == 0
    assert read_runs(after / job_id) == runs
