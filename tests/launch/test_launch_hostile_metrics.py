"""Rank metric records are untrusted: non-finite and huge numbers, and a group name that is a path,
under a real `hgtrain launch --tensorboard` (local transport), then `metrics --format tensorboard`
and `report` on the recorded job."""
from __future__ import annotations

import json
import sys

from hgcli.cli import main

from .hg import cluster_toml
from .plans import local_cluster, make_plan, plan_file

PY = sys.executable

RANK = r"""
import json, os
fd, rank = int(os.environ['HGTRAIN_METRICS_FD']), int(os.environ['RANK'])
def raw(text):
    os.write(fd, text.encode() + b'\n')
raw('{"step": Infinity, "samples": 4, "time": 1000.0}')
raw('{"step": NaN, "samples": 4, "time": 1000.5}')
raw('{"step": 3, "samples": 4, "time": 1' + '0' * 400 + '}')
raw('{"event": "eval", "step": 1, "accuracy": 1' + '0' * 400 + ', "time": 1000.7}')
raw('{"event": "ps_push", "staleness": 1, "version": 1, "group": "/../../../../../../%s/x", "time": 1000.8}'
    % os.environ['ESCAPE_TO'].strip('/'))
raw('{"lr": [0.1, -Infinity], "step": 0, "samples": 4, "time": 1000.9}')
for step in range(1, 4):
    raw(json.dumps({'step': step, 'loss': 0.5, 'samples': 4, 'time': 1001.0 + step}))
print('done', rank)
"""


def _strict(text: str) -> list[dict]:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines() if line.strip()]


def test_bad_numbers_are_missing_said_once_per_rank_and_group_names_never_become_paths(hg, tmp_path, capsys):
    cluster = local_cluster(("a",))
    plan = make_plan(cluster, (("a", "a"),), predicted=8.0)
    ctoml, pfile = cluster_toml(tmp_path / "cluster.toml", cluster), plan_file(tmp_path, plan)
    live, escape = tmp_path / "tb" / "live", tmp_path / "escaped"
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--tensorboard", str(live), "--json", "--",
                            PY, "-c", RANK, env=hg.env(ESCAPE_TO=str(escape)))
    assert code == 0, err
    events = _strict(out)                                   # --json stays JSON
    assert [e["event"] for e in events].count("rank_exited") == 2
    notices = [e["message"] for e in events if e["event"] == "notice" and "not finite" in e["message"]]
    assert sorted(n.split(":")[0] for n in notices) == ["rank 0", "rank 1"]     # once per rank
    assert all(n.endswith("(step)") for n in notices)       # the first bad record's keys
    [job_id] = hg.job_ids()
    recorded = _strict((hg.job_dir(job_id) / "metrics.jsonl").read_text())
    assert [m["step"] for m in recorded if m["rank"] == 0 and "event" not in m] == [None, None, 3, 0, 1, 2, 3]
    assert [m["time"] for m in recorded if m["rank"] == 0][2] is None
    assert {e["summary"]["samples"] for e in events if e["event"] == "job_ended"} == {2 * 5 * 4}
    # run directories only from the plan; nothing written through the record's "group"
    assert not escape.exists()
    assert sorted(p.name for p in (live / job_id).iterdir()) == ["group0", "job", "rank0", "rank1"]
    capsys.readouterr()
    assert main(["metrics", job_id, "--format", "tensorboard", "-o", str(tmp_path / "after")]) == 0
    assert sorted(p.name for p in (tmp_path / "after" / job_id).iterdir()) == ["group0", "job", "rank0", "rank1"]
    assert not escape.exists()
    assert main(["report", job_id, "-o", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").stat().st_size > 1000
