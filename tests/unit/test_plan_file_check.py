"""``launch --plan FILE`` checks a hand-edited plan whole at load: exit 2 naming file and field, and
nothing recorded or started (the real CLI on the embedded-style local cluster)."""
from __future__ import annotations

import json

import pytest

from hgcli.cli import main
from tests.launch.hg import cluster_toml
from tests.launch.plans import local_cluster, make_plan, plan_file


def _edit_rank(field, value, rank=1):
    def edit(plan):
        plan["ranks"][rank][field] = value
    return edit


def _drop_rank(plan):
    del plan["ranks"][1]
    plan["world_size"] = 2
    plan["groups"][0]["ranks"] = [0]


def _duplicate_rank(plan):
    plan["ranks"][1]["rank"] = 0


def _worker_as_shard(plan):
    plan["ps_shards"] = [0]


def _world_size(plan):
    plan["world_size"] = 5


def _group_lists_ps(plan):
    plan["groups"][0]["ranks"] = [0, 1, 2]


@pytest.mark.parametrize("edit, field, words", [
    (_drop_rank, "ranks[1].rank", "rank 1 is missing"),
    (_duplicate_rank, "ranks[0].rank", "rank 0 is listed 2 times"),
    (_world_size, "world_size", "is 5 but the plan lists 3 rank(s)"),
    (_edit_rank("batch_size", -5), "ranks[1].batch_size", "at least 1, not -5"),
    (_worker_as_shard, "ps_shards[0]", "rank 0 is a worker"),
    (_group_lists_ps, "groups[0].ranks", "rank 2, a parameter-server rank"),
])
def test_broken_plan_file_is_refused_before_anything_starts(edit, field, words, tmp_path, private_state_dir, capsys):
    cluster = local_cluster(("a",))
    path = plan_file(tmp_path, make_plan(cluster, [["a", "a"]], ps=["a"]))
    plan = json.loads(path.read_text())
    edit(plan)
    path.write_text(json.dumps(plan))
    code = main(["launch", "-c", str(cluster_toml(tmp_path / "c.toml", cluster)), "--plan", str(path), "--",
                 "true"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{path}: not a valid plan: {field}: " in err and words in err and err.count("\n") == 1
    assert not (private_state_dir / "jobs").exists() or not any((private_state_dir / "jobs").iterdir())


def test_ranks_out_of_order_are_put_in_order(tmp_path):
    from hgcli.plan.files import load_plan

    cluster = local_cluster(("a",))
    path = plan_file(tmp_path, make_plan(cluster, [["a", "a"]], ps=["a"]))
    plan = json.loads(path.read_text())
    plan["ranks"].reverse()
    path.write_text(json.dumps(plan))
    assert [r.rank for r in load_plan(path, cluster).ranks] == [0, 1, 2]
