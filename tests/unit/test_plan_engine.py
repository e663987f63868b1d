"""``--engine``: each group's engine in the plan (GroupPlan.engine), its JSON and its refusals."""
from __future__ import annotations

import json

from hgcli.cli import main
from hgcli.schema.stages import Engine, Plan, from_dict
from tests.unit.test_plan_cli import store
from tests.strictjson import loads as strict_json


def _plan(capsys, *args: str) -> Plan:
    assert main(["plan", "--json", "--global-batch", "128", *args]) == 0
    return from_dict(Plan, strict_json(capsys.readouterr().out))


def test_plan_json_names_each_groups_engine(capsys):
    store()
    assert [g.engine for g in _plan(capsys).groups] == [Engine.DDP]     # auto: ddp, no memory model yet
    sharded = _plan(capsys, "--engine", "fsdp", "--strategy", "allreduce")
    assert [g.engine for g in sharded.groups] == [Engine.FSDP]
    # Its prediction prices the gathers (docs/planning.md, "Sharded groups"): below DDP's on the same devices.
    ddp = _plan(capsys, "--engine", "ddp", "--strategy", "allreduce")
    assert sharded.predicted_samples_per_s["allreduce"] < ddp.predicted_samples_per_s["allreduce"]
    assert "one fsdp all-reduce group of 4" in sharded.reason
    raw = json.loads(json.dumps({"id": 0, "ranks": [0, 1]}))
    assert from_dict(type(sharded.groups[0]), raw).engine is Engine.DDP    # plan files from before
    assert main(["plan", "--engine", "fsdp", "--strategy", "allreduce"]) == 0
    assert "group 0 · fsdp · 4 rank(s) · FSDP2" in capsys.readouterr().out


def test_fsdp_groups_under_parameter_servers_are_refused_in_one_line(capsys):
    """Before probing or benching anything (no stage line); as the plan is made where auto chose hybrid."""
    store()
    assert main(["plan", "--engine", "fsdp", "--strategy", "hybrid", "--ps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("hgtrain: error: --engine fsdp: a hybrid plan cannot have fsdp groups yet (sharded groups "
                   "exchange with parameter servers in a later version); plan with --strategy allreduce, "
                   "or --engine ddp")
