"""Pure pieces of launch: environment layers, env files, rank filters, master address, metrics."""
from __future__ import annotations

import pytest

from hgcli.errors import ConfigError, UsageError
from hgcli.launch.addresses import bind_address, master_address
from hgcli.launch.launcher import user_env
from hgcli.launch.request import LaunchRequest
from hgcli.launch.inbound import Exited
from hgcli.launch.metrics import MetricsBoard
from hgcli.launch.spec import CheckpointPolicy, NodeLaunch, agent_spec, forwarded_env, read_env_file
from hgcli.runtime.env import cuda_visible_devices
from hgcli.schema.records import FinishRecord, encode
from hgcli.schema.stages import Cluster, NodeSpec, RankPlan, Role
from hgcli.config.ranklist import parse_rank_list

from .plans import local_cluster, make_plan


def test_env_file_syntax_and_errors_name_the_line(tmp_path):
    path = tmp_path / "a.env"
    path.write_text("# c\n\nexport A=1\nB='two words'\nC=\"x=y\"\nD=\nE='unbalanced\n")
    assert read_env_file(path) == {"A": "1", "B": "two words", "C": "x=y", "D": "", "E": "'unbalanced"}
    path.write_text("A=1\nnot an assignment\n")
    with pytest.raises(ConfigError, match=r"a\.env:2"):
        read_env_file(path)
    with pytest.raises(ConfigError, match="cannot read env file"):
        read_env_file(tmp_path / "missing.env")


def test_forwarded_allowlist_and_precedence(tmp_path):
    environ = {"NCCL_DEBUG": "INFO", "HGTRAIN_X": "1", "PYTHONPATH": "/p", "HOME": "/h", "AWS_SECRET": "s",
               "HGTRAIN_STATE_DIR": "/state"}
    assert forwarded_env(environ) == {"NCCL_DEBUG": "INFO", "HGTRAIN_X": "1", "PYTHONPATH": "/p"}
    (tmp_path / "f.env").write_text("NCCL_DEBUG=WARN\nA=file\n")
    req = LaunchRequest(cluster=local_cluster(), command=("x",), env=("A=flag", "B=x=y"),
                        env_file=tmp_path / "f.env")
    assert user_env(req, environ) == {"NCCL_DEBUG": "WARN", "HGTRAIN_X": "1", "PYTHONPATH": "/p",
                                      "A": "flag", "B": "x=y"}
    with pytest.raises(UsageError, match="env: expected"):
        user_env(LaunchRequest(cluster=local_cluster(), command=("x",), env=("NOT A NAME",)), {})


def test_request_validation():
    with pytest.raises(UsageError, match="nothing to launch"):
        LaunchRequest(cluster=local_cluster(), command=())
    assert LaunchRequest(cluster=local_cluster(), command=("x",), heartbeat_timeout_s=8).heartbeat_interval_s == 2
    with pytest.raises(UsageError, match="detach must be False"):
        LaunchRequest(cluster=local_cluster(), command=("x",), restarts=1, detach=True)
    with pytest.raises(UsageError, match=">= 0"):
        LaunchRequest(cluster=local_cluster(), command=("x",), checkpoint_every=-1)


def test_the_command_line_names_its_flags_and_the_request_its_fields(capsys):
    """cli.py checks launch's flags before anything is loaded or contacted (click's usage error, exit 2,
    the flag named); the request refuses the same values by the names of its fields."""
    from hgcli.cli import main

    for argv, words in ((["--restarts", "1", "--detach"], "--restarts needs hgtrain to stay attached"),
                        (["--tensorboard", "tb", "--detach"], "--tensorboard needs hgtrain to stay attached"),
                        (["--nnodes", "2:1"], "Invalid value for '--nnodes'"),
                        (["--nnodes", "x"], "Invalid value for '--nnodes'"),
                        (["--ranks", "3-1"], "Invalid value for '--ranks'"),
                        (["--env", "NOT A NAME"], "Invalid value for '--env'"),
                        (["--secret-env", "DB-URL"], "Invalid value for '--secret-env'"),
                        (["--grace", "-1"], "Invalid value for '--grace'"),
                        ([], "no command to launch")):
        assert main(["launch", *argv, "--", "true"] if argv else ["launch"]) == 2, argv
        assert words in capsys.readouterr().err, argv
    with pytest.raises(UsageError, match="grace_s must be >= 0"):
        LaunchRequest(cluster=local_cluster(), command=("x",), grace_s=-1)
    with pytest.raises(UsageError, match="heartbeat_timeout_s must be at least 1"):
        LaunchRequest(cluster=local_cluster(), command=("x",), heartbeat_timeout_s=0.5)


def test_ps_ranks_get_the_checkpoint_policy_and_resume_only_when_told():
    cluster = local_cluster(("a",))
    plan = make_plan(cluster, [["a"]], ps=["a"])
    node = NodeLaunch(name="a", python="py", package_root="/pkg", job_dir="/j-r1/a", plan_path="/j-r1/a/plan.json",
                      checkpoint_dir="/j/a/ps-checkpoint")
    common = dict(plan=plan, job_id="j-r1", node=node, command=("train",), user_env={}, master_addr="h",
                  master_port=1, jobs_root="/r", grace_s=1, heartbeat_interval_s=1, heartbeat_timeout_s=4,
                  detach=False)
    ps = agent_spec(**common, checkpoint=CheckpointPolicy(every=5, seconds=30.0, resume=True)).ranks[1].argv
    assert ps[1:] == ("-m", "hgcli.runtime.ps", "--checkpoint-dir", "/j/a/ps-checkpoint", "--checkpoint-every",
                      "5", "--checkpoint-seconds", "30.0", "--resume")
    assert agent_spec(**common).ranks[1].argv[-2:] == ("--checkpoint-dir", "/j/a/ps-checkpoint")
    assert agent_spec(**common).ranks[0].argv == ("train",)


def test_parse_rank_list():
    assert parse_rank_list("0,2-3") == {0, 2, 3}
    # The audit's finds: "²" passes str.isdigit and int() refuses it; 5,000 digits hit int()'s limit;
    # 0-99999999999 was built as a set in memory.
    for bad in ("a", "3-1", "1-", "-1", "", "²", "1-²", "9" * 5000, "0-99999999999"):
        with pytest.raises(UsageError, match="rank list"):
            parse_rank_list(bad)
    assert len(parse_rank_list("0-131071")) == 131072


def test_host_names_end_where_they_end():
    from hgcli.schema.names import valid_host

    assert valid_host("127.0.0.9") and valid_host("gpu-1.lab") and valid_host("fe80::1%eth0")
    assert not valid_host("127.0.0.9\n") and not valid_host("-oProxyCommand=x") and not valid_host("")


def test_cuda_visible_devices_per_rank():
    real = RankPlan(rank=0, role=Role.WORKER, node="n", device="gpu3")
    assert cuda_visible_devices(real) == "3"
    assert cuda_visible_devices(RankPlan(rank=1, role=Role.PS, node="n", device="cpu")) == ""
    assert cuda_visible_devices(RankPlan(rank=2, role=Role.WORKER, node="n", device="gpu0", emulated=True)) is None


def test_agent_spec_puts_the_package_first_and_each_rank_on_its_node():
    cluster = local_cluster(("a", "b"))
    plan = make_plan(cluster, [["a", "b", "a"]])
    node = NodeLaunch(name="a", python="py", package_root="/pkg", job_dir="/j", plan_path="/j/plan.json",
                      checkpoint_dir="/j/ps-checkpoint")
    spec = agent_spec(plan=plan, job_id="j-1", node=node, command=("train",), user_env={"PYTHONPATH": "/u"},
                      master_addr="10.0.0.1", master_port=1234, jobs_root="/r", grace_s=1,
                      heartbeat_interval_s=1, heartbeat_timeout_s=4, detach=False)
    assert [r.rank for r in spec.ranks] == [0, 2]
    assert spec.env["PYTHONPATH"] == "/pkg:/u"
    r2 = spec.ranks[1]
    assert r2.argv == ("train",)
    assert (r2.env["RANK"], r2.env["LOCAL_RANK"], r2.env["LOCAL_WORLD_SIZE"], r2.env["MASTER_PORT"]) == (
        "2", "1", "2", "1234")
    assert r2.env["HGTRAIN_PLAN"] == "/j/plan.json" and "CUDA_VISIBLE_DEVICES" not in r2.env


def test_each_node_listens_on_its_cluster_address_and_every_rank_gets_the_job_token():
    """Listeners bind where the peers reach a node (docs/security.md); the token travels in the spec only."""
    from hgcli.node.agent.secrets import REDACTED, redact_env

    local = NodeSpec(name="me", host="localhost")
    far = NodeSpec(name="far", host="gpu7", hostname="10.0.0.7")
    both = Cluster(nodes=(local, far))
    mixed = make_plan(both, [["far", "me"]])
    assert bind_address(far, mixed, both) == "10.0.0.7"
    assert bind_address(local, mixed, both) is None          # no address known that "far" uses for it
    alone = Cluster(nodes=(local,))
    assert bind_address(local, make_plan(alone, [["me", "me"]]), alone) == "127.0.0.1"
    node = NodeLaunch(name="far", python="py", package_root="/pkg", job_dir="/j", plan_path="/j/plan.json",
                      checkpoint_dir="/j/ps-checkpoint")
    spec = agent_spec(plan=mixed, job_id="j-1", node=node, command=("train",), user_env={"DSN": "x"},
                      master_addr="10.0.0.7", master_port=1234, jobs_root="/r", grace_s=1,
                      heartbeat_interval_s=1, heartbeat_timeout_s=4, detach=False, bind_addr="10.0.0.7",
                      token="t" * 32, secret=("DSN",))
    env = spec.ranks[0].env
    assert (env["HGTRAIN_BIND_ADDR"], env["HGTRAIN_JOB_TOKEN"]) == ("10.0.0.7", "t" * 32)
    assert redact_env(env, spec.secret)["HGTRAIN_JOB_TOKEN"] == REDACTED     # what agent.json keeps
    assert spec.secret == ("DSN",) and redact_env(spec.env, spec.secret)["DSN"] == REDACTED
    with pytest.raises(UsageError, match="secret_env: expected a variable name"):
        LaunchRequest(cluster=alone, command=("x",), secret_env=("DB-URL",))


def test_master_address_refuses_a_local_rank0_with_remote_nodes():
    local = NodeSpec(name="me", host="localhost")
    remote = NodeSpec(name="far", host="10.0.0.7")
    both = Cluster(nodes=(local, remote))
    assert master_address(make_plan(both, [["far", "me"]]), both) == "10.0.0.7"
    with pytest.raises(UsageError, match="cannot reach as 127.0.0.1"):
        master_address(make_plan(both, [["me", "far"]]), both)
    alone = Cluster(nodes=(local,))
    assert master_address(make_plan(alone, [["me"]]), alone) == "127.0.0.1"


def test_exit_code_of_a_signal_is_128_plus_it():
    assert Exited.decode({"rank": 0, "code": None, "signal": 9, "state": "failed"}).exit_code == 137
    assert Exited.decode({"rank": 0, "code": 3, "signal": None, "state": "failed"}).exit_code == 3


def test_metrics_board_rates_come_from_the_ranks_own_clock():
    cluster = local_cluster()
    plan = make_plan(cluster, [["local", "local"], ["local"]], ps=["local"], predicted=100.0)
    board = MetricsBoard(plan)
    for t in range(5):                    # group 0: 2 ranks x 10 samples per second
        for r in (0, 1):
            board.add(r, {"step": t, "samples": 10, "loss": 1.0 / (t + 1), "time": 100.0 + t})
    board.add(2, {"step": 0, "samples": 5, "time": 100.0})
    board.add(2, {"step": 1, "samples": 5, "time": 101.0})
    board.add(2, {"event": "eval", "step": 1, "samples": 999, "accuracy": 0.9})   # not a training step
    board.add(3, {"step": 1, "samples": 1})                                          # a PS rank: ignored
    view = board.view()
    assert [(g.group, g.ranks, g.step) for g in view.groups] == [("0", (0, 1), 4), ("1", (2,), 1)]
    assert view.groups[0].loss == pytest.approx(0.2)
    assert view.groups[0].samples_per_s == pytest.approx(20.0)   # each rank's first record opens its window
    assert view.samples_per_s == pytest.approx(25.0)
    assert view.predicted_samples_per_s == 100.0 and view.ideal_samples_per_s == 125.0
    summary = board.summary(elapsed_s=7.0)
    assert summary.samples == 110 and summary.accuracy == 0.9
    assert summary.groups == {"0": pytest.approx(20.0), "1": pytest.approx(5.0)}
    # The job's throughput counts the time group 1 no longer trained: 85 samples after each
    # worker's first step over the 4 s from the first step to the last, not 20 + 5.
    assert summary.samples_per_s == pytest.approx(85 / 4)
    assert summary.group_spans == {"0": 4.0, "1": 1.0}
    from hgcli.render.launch import summary_lines

    assert ("groups finished apart (training time group 0 4 s, group 1 1 s): each group runs the same steps "
            "at its own pace, and one whose share of each step was small for its speed waited for the others "
            "at the end") in summary_lines(summary)


def finish(steps: int = 3, **fields) -> dict:
    """A worker's finish record of 30 samples, as the runtime writes it."""
    return encode(FinishRecord(samples=30, steps=steps, compute_s=1.0, emulated_sleep_s=0.0, emulated_step_s=0.0,
                               **fields))


def test_the_summary_sets_each_devices_measured_compute_rate_against_its_bench():
    import dataclasses

    from hgcli.render.launch import summary_lines

    plan = make_plan(local_cluster(), [["local", "local"]], predicted=100.0)
    ranks = tuple(dataclasses.replace(r, benched_samples_per_s=50.0) if r.rank == 0 else r for r in plan.ranks)
    board = MetricsBoard(dataclasses.replace(plan, ranks=ranks))
    for t in range(3):
        for r in (0, 1):
            board.add(r, {"step": t, "samples": 10, "time": 100.0 + t})
    board.add(0, finish(compute_samples_per_s=40.0))
    board.add(1, finish(compute_samples_per_s=None))                                    # not measured
    board.add(1, {"event": "eval", "compute_samples_per_s": 7.0})                       # not a finish
    summary = board.summary(elapsed_s=3.0)
    assert summary.device_measured == {"0": 40.0} and summary.device_benched == {"0": 50.0}
    assert ("per device, samples/s of compute (waits left out) against the bench: rank 0 40 of 50 (80%)"
            in summary_lines(summary))


def test_the_summary_says_what_the_prediction_came_from_and_keeps_each_workers_mean_batch():
    import dataclasses

    from hgcli.render.launch import summary_lines

    plan = make_plan(local_cluster(), [["local", "local"]], predicted=100.0)
    plan = dataclasses.replace(plan, ranks=tuple(dataclasses.replace(r, benched_samples_per_s=50.0)
                                                 for r in plan.ranks))
    board = MetricsBoard(plan)
    for t in range(3):
        for r in (0, 1):
            board.add(r, {"step": t, "samples": 10, "time": 100.0 + t})
    board.add(0, finish(steps=4, compute_samples_per_s=40.0, compute_noise=0.3))
    board.add(1, finish(steps=0, compute_samples_per_s=20.0))                           # no step count
    assert board.finished() == {0: (40.0, 7.5, 0.3)}
    benched = summary_lines(board.summary(elapsed_s=3.0, rates_stored=True))
    assert ("the prediction came from the bench's model, each device timed alone, not from this script's "
            "run; the next launch of this script plans from the compute this job measured") in benched
    by_hand = MetricsBoard(make_plan(local_cluster(), [["local"]], predicted=100.0))
    for t in range(3):
        by_hand.add(0, {"step": t, "samples": 10, "time": 100.0 + t})
    hand_made = summary_lines(by_hand.summary(elapsed_s=1.0))
    assert hand_made and not any(line.startswith("the prediction") for line in hand_made)
    refitted = MetricsBoard(dataclasses.replace(plan, fitted_to="hg-1"))
    for t in range(3):
        refitted.add(0, {"step": t, "samples": 10, "time": 100.0 + t})
    refitted.add(0, finish(steps=4, compute_samples_per_s=40.0))
    fitted = summary_lines(refitted.summary(elapsed_s=3.0))
    assert "the prediction is fitted to the compute this script measured in job hg-1" in fitted
    assert any(line.startswith("per device, samples/s of compute (waits left out) against the plan's (fitted)")
               for line in fitted)
    # A plan from a bench of each node's devices together says so, and so does its per-device line.
    together = MetricsBoard(dataclasses.replace(plan, bench_together=True))
    for t in range(3):
        together.add(0, {"step": t, "samples": 10, "time": 100.0 + t})
    together.add(0, finish(steps=4, compute_samples_per_s=40.0))
    lines = summary_lines(together.summary(elapsed_s=3.0))
    assert ("the prediction came from the bench's model, each node's devices timed together, not from this "
            "script's run") in lines
    assert ("per device, samples/s of compute (waits left out) against the bench (devices together): "
            "rank 0 40 of 50 (80%)") in lines


def test_the_controller_side_of_launch_never_imports_torch():
    """torch takes seconds to import; the launcher only needs the runtime's environment contract."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from hgcli.cli import cli\n"
            "import hgcli.launch.launcher, hgcli.render.launch\n"
            "from tests.launch.plans import local_cluster, make_plan\n"
            "from hgcli.launch.spec import CheckpointPolicy, NodeLaunch, agent_spec\n"
            "c = local_cluster(('a',)); p = make_plan(c, [['a']], ps=['a'])\n"
            "n = NodeLaunch(name='a', python='py', package_root='/p', job_dir='/j', plan_path='/j/p', checkpoint_dir='/j/c')\n"
            "agent_spec(plan=p, job_id='j', node=n, command=('x',), user_env={}, master_addr='h',\n"
            "           master_port=1, jobs_root='/r', grace_s=1, heartbeat_interval_s=1,\n"
            "           heartbeat_timeout_s=4, detach=False)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_plain_launch_imports_neither_rich_nor_invoke_and_match_exec_still_works():
    """Start-up of `hgtrain launch` in a script or CI: rich is for terminals only, and paramiko's
    import of invoke (only for ssh-config `Match exec`) is deferred until such a Match runs."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from hgcli.cli import cli\n"
            "import hgcli.launch.launcher, hgcli.remote.ssh, hgcli.launch.agentlink\n"
            "from hgcli.cli import launch_sink\n"
            "launch_sink(as_json=False, ranks=None)\n"
            "loaded = [m for m in ('rich', 'invoke.collection', 'asyncio') if m in sys.modules]\n"
            "assert not loaded, loaded\n"
            "import paramiko\n"
            "config = paramiko.SSHConfig.from_text('Match exec true\\n  User bob\\nMatch exec false\\n  Port 99\\n')\n"
            "assert config.lookup('x') == {'user': 'bob', 'hostname': 'x'}, config.lookup('x')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr


def test_group_predictions_come_from_the_plan_or_split_its_total_by_samples_per_step():
    import dataclasses

    from hgcli.launch.metrics import group_predictions

    cluster = local_cluster()
    plan = make_plan(cluster, [["local", "local"], ["local"]], ps=["local"], predicted=90.0)
    assert group_predictions(plan) == ({"0": pytest.approx(60.0), "1": pytest.approx(30.0)}, True)
    one = make_plan(cluster, [["local", "local"]], predicted=90.0)
    assert group_predictions(one) == ({"0": pytest.approx(90.0)}, False)   # one group: the total, exactly
    own = dataclasses.replace(plan, predicted_group_samples_per_s={"0": 70.0, "1": 20.0})
    assert group_predictions(own) == ({"0": 70.0, "1": 20.0}, False)
    assert group_predictions(make_plan(cluster, [["local"]])) == ({}, False)   # nothing predicted
    summary = MetricsBoard(own).summary(elapsed_s=1.0)
    assert summary.strategy == "hybrid" and summary.predictions == {"hybrid": 90.0, "ideal": 112.5}
    assert summary.group_predicted == {"0": 70.0, "1": 20.0} and not summary.group_predicted_derived


def test_a_plan_without_per_group_predictions_still_loads():
    from hgcli.schema.codec import from_dict, to_dict
    from hgcli.schema.stages import Plan

    plan = make_plan(local_cluster(), [["local"]], predicted=10.0)
    data = to_dict(plan)
    assert data["predicted_group_samples_per_s"] == {}
    del data["predicted_group_samples_per_s"]          # a plan file written before the field
    assert from_dict(Plan, data) == plan


def test_a_restarted_attempt_that_trained_nothing_is_told_and_others_are_not():
    from hgcli.launch.launcher import untrained_restart
    from hgcli.schema.states import JobState
    note = untrained_restart(1, JobState.SUCCEEDED, 0)
    assert note is not None and note.startswith("attempt 1 resumed and ended without training a sample")
    assert "Data position and resume" in note
    assert untrained_restart(0, JobState.SUCCEEDED, 0) is None        # a first attempt: nothing resumed
    assert untrained_restart(2, JobState.SUCCEEDED, 64) is None       # it trained
    assert untrained_restart(1, JobState.FAILED, 0) is None           # the failure says it already


def test_launch_passes_strategy_global_batch_and_ps_to_the_planner(monkeypatch):
    """`hgtrain launch --strategy hybrid --global-batch 64 --ps 2` plans as `hgtrain plan` would
    with those flags: the request's job carries them (elastic re-plans and re-grouping reuse it)."""
    from click.testing import CliRunner

    import hgcli.launch.launcher as launcher
    from hgcli.cli import cli
    from hgcli.schema.stages import Strategy

    seen = []

    def fake_launch(request, sink):
        seen.append(request)
        raise SystemExit(0)

    monkeypatch.setattr(launcher, "launch", fake_launch)
    result = CliRunner().invoke(cli, ["launch", "--nproc-per-node", "2", "--strategy", "hybrid",
                                      "--global-batch", "64", "--ps", "2", "--", "python", "x.py"])
    assert result.exit_code == 0, result.output
    job = seen[0].job
    assert (job.strategy, job.global_batch, job.ps_ranks) == (Strategy.HYBRID, 64, 2)
    assert CliRunner().invoke(cli, ["launch", "--ps", "0", "--", "python", "x.py"]).exit_code == 2


def test_errors_show_control_characters_from_files_and_seconds_are_finite(tmp_path, capsys):
    """A plan's node name with an escape sequence reached the terminal raw in "unknown node(s)";
    `--heartbeat-timeout nan` turned loss detection off and `--grace inf` waited for ever."""
    import dataclasses

    from hgcli.cli import main
    from tests.launch.hg import cluster_toml
    from tests.launch.plans import local_cluster, make_plan, plan_file

    cluster = local_cluster(("a",))
    plan = make_plan(cluster, [["a"]])
    evil = "\x1b]52;c;aGk=\x07x"
    plan = dataclasses.replace(plan, ranks=tuple(dataclasses.replace(r, node=evil) for r in plan.ranks))
    ctoml, pfile = cluster_toml(tmp_path / "c.toml", cluster), plan_file(tmp_path, plan)
    assert main(["launch", "-c", str(ctoml), "--plan", str(pfile), "--", "python", "-c", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown node(s) ^[]52;c;aGk=^Gx" in err and "\x1b" not in err and "\x07" not in err
    for flag, value in (("--heartbeat-timeout", "nan"), ("--grace", "inf"), ("--checkpoint-seconds", "nan")):
        assert main(["launch", flag, value, "--", "python", "-c", "1"]) == 2
        assert "is not a finite number of seconds" in capsys.readouterr().err


def test_a_groups_loss_is_its_union_batchs_weighted_by_samples():
    """Issue 52: the per-group loss (report, TensorBoard) was the plain mean of the members' losses,
    so a 1-sample member counted as much as a 15-sample one."""
    from hgcli.launch.series import Series
    from tests.launch.plans import local_cluster, make_plan

    series = Series(make_plan(local_cluster(("a",)), [["a", "a"]]))
    points = series.add(0, {"time": 10.0, "step": 0, "loss": 1.0, "samples": 15})
    points += series.add(1, {"time": 10.1, "step": 0, "loss": 3.0, "samples": 1})
    [loss] = [p.value for p in points if p.run == "group0" and p.tag == "loss"]
    assert loss == pytest.approx((15 * 1.0 + 1 * 3.0) / 16)
