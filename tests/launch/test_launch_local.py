"""`hgtrain launch` end to end on nodes of this machine (local transport): real agents, real ranks,
real signals. The same scenarios over real sshd test hosts are in test_launch_ssh.py."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

from tests.strictjson import loads as strict_json
from hgcli.node.agent.control import AGENT_EXTRA_WAIT_S
from tests.agent.harness import rank_pids, job_pids, wait_until

from .hg import assert_not_in_any_cmdline, cluster_toml, text_under
from .plans import local_cluster, make_plan, plan_file

PY = sys.executable

REPORT = """
import json, os, sys
keys = ['RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'HGTRAIN_ROLE',
        'HGTRAIN_GROUP', 'HGTRAIN_BATCH_SIZE', 'HGTRAIN_JOB_ID', 'NCCL_DEBUG', 'FROM_FILE', 'FROM_FLAG']
print(json.dumps({k: os.environ.get(k) for k in keys}))
print('to stderr', file=sys.stderr)
plan = json.load(open(os.environ['HGTRAIN_PLAN']))
print('plan world', plan['world_size'])
import hgcli.runtime.env
fd = int(os.environ['HGTRAIN_METRICS_FD'])
os.write(fd, json.dumps({'step': 1, 'loss': 0.5, 'samples': 16, 'time': 1000.0 + int(os.environ['RANK'])}).encode() + b'\\n')
os.write(fd, json.dumps({'step': 2, 'loss': 0.25, 'samples': 16, 'time': 1001.0 + int(os.environ['RANK'])}).encode() + b'\\n')
"""


def setup(tmp_path, nodes=("a", "b"), groups=(("a", "a"), ("b",)), ps=()):
    """Plans with PS ranks run the runtime's parameter server, which expects real training ranks:
    those are in test_launch_training.py; here the ranks are plain scripts."""
    cluster = local_cluster(nodes)
    plan = make_plan(cluster, [list(g) for g in groups], ps=list(ps), predicted=40.0)
    return cluster, plan, cluster_toml(tmp_path / "cluster.toml", cluster), plan_file(tmp_path, plan)


def test_hybrid_job_on_two_nodes_runs_to_completion_with_tagged_logs_files_and_record(hg, tmp_path):
    cluster, plan, ctoml, pfile = setup(tmp_path, groups=(("a", "a"), ("b",)), ps=())
    (tmp_path / "vars.env").write_text("# comment\nexport FROM_FILE='file value'\nFROM_FLAG=file\n")
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--env-file", str(tmp_path / "vars.env"),
                            "--env", "FROM_FLAG=flag", "--json", "--", PY, "-c", REPORT,
                            env=hg.env(NCCL_DEBUG="WARN"))
    assert code == 0, err
    events = [strict_json(line) for line in out.splitlines()]   # nothing but JSON on stdout
    assert {e["job_id"] for e in events} == {events[0]["job_id"]}
    job_id = events[0]["job_id"]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "job_started" and kinds[-1] == "job_ended"
    assert kinds.count("rank_started") == 3 and kinds.count("rank_exited") == 3
    ended = events[-1]
    assert ended["state"] == "succeeded" and ended["exit_code"] == 0 and ended["root_cause"] is None
    # 3 ranks x 2 steps x 16 samples; rates from each rank's own stamps (1 s apart): 16/s per rank.
    # The job's throughput: the 48 samples after each rank's first step over the 3 s from the first
    # rank's first stamp to the last rank's last (rank r stamps 1000 + r and 1001 + r).
    assert ended["summary"]["samples"] == 96 and ended["summary"]["samples_per_s"] == 16.0
    assert ended["summary"]["group_spans"] == {"0": 2.0, "1": 1.0}
    assert ended["summary"]["groups"] == {"0": 32.0, "1": 16.0} and ended["summary"]["predicted_samples_per_s"] == 40.0
    logs = [e for e in events if e["event"] == "log"]
    for rank, node, local in ((0, "a", 0), (1, "a", 1), (2, "b", 0)):
        mine = [e for e in logs if e["rank"] == rank]
        assert {e["node"] for e in mine} == {node}
        env = json.loads(next(e["line"] for e in mine if e["line"].startswith("{")))
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "3" and env["LOCAL_RANK"] == str(local)
        assert env["LOCAL_WORLD_SIZE"] == ("2" if node == "a" else "1")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["HGTRAIN_JOB_ID"] == job_id
        assert env["NCCL_DEBUG"] == "WARN"                              # forwarded allowlist
        assert env["FROM_FILE"] == "file value" and env["FROM_FLAG"] == "flag"   # --env beats the file
        assert env["HGTRAIN_BATCH_SIZE"] == "16"
        assert ("err", "to stderr") in {(e["stream"], e["line"]) for e in mine}
        assert ("out", "plan world 3") in {(e["stream"], e["line"]) for e in mine}
        # every line of the rank is in its own file on the controller
        text = (hg.job_dir(job_id) / f"rank{rank}.log").read_text()
        assert "to stderr\n" in text and "plan world 3\n" in text
    assert len({json.loads(e["line"])["MASTER_PORT"] for e in logs if e["line"].startswith("{")}) == 1
    metrics = [json.loads(line) for line in (hg.job_dir(job_id) / "metrics.jsonl").read_text().splitlines()]
    assert sorted((m["rank"], m["step"]) for m in metrics) == [(r, s) for r in range(3) for s in (1, 2)]
    record = hg.record(job_id)
    assert record["state"] == "succeeded" and record["exit_code"] == 0 and record["ended_at"]
    assert [(r["rank"], r["state"], r["exit_code"]) for r in record["ranks"]] == [
        (0, "succeeded", 0), (1, "succeeded", 0), (2, "succeeded", 0)]
    assert record["ranks"][2]["last_metrics"]["step"] == 2
    assert oct(os.stat(hg.job_dir(job_id) / "job.json").st_mode & 0o777) == "0o600"
    assert oct(os.stat(hg.job_dir(job_id) / "rank0.log").st_mode & 0o777) == "0o600"


FAIL_ONE = """
import os, sys, time
if os.environ['RANK'] == '2':
    time.sleep(1)
    print('about to fail', flush=True)
    print('boom', file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(600)
"""


def test_rank_exiting_3_stops_every_rank_on_every_node_and_is_named_first(hg, tmp_path):
    _, plan, ctoml, pfile = setup(tmp_path, groups=(("a", "a"), ("b", "b")))
    run = hg.start("-c", str(ctoml), "--plan", str(pfile), "--grace", "2", "--", PY, "-c", FAIL_ONE)
    code = run.finish()
    assert code == 3, run.stderr
    first = run.stderr.splitlines()
    cause = [i for i, line in enumerate(first) if "root cause" in line]
    assert cause, run.stderr
    assert "b:2 exited with code 3" in first[cause[0]]
    # its last lines follow the root cause
    assert "boom" in "\n".join(first[cause[0]:]) and "about to fail" in "\n".join(first[cause[0]:])
    job_id = hg.job_ids()[0]
    assert job_pids(job_id) == []
    record = hg.record(job_id)
    assert record["state"] == "failed" and record["exit_code"] == 3
    assert record["root_cause"].startswith("b:2 exited with code 3")
    states = {r["rank"]: r["state"] for r in record["ranks"]}
    assert states[2] == "failed" and all(states[r] == "stopped" for r in (0, 1, 3))


def test_rank_killed_by_sigkill_from_outside_fails_the_job_with_137(hg, tmp_path):
    _, plan, ctoml, pfile = setup(tmp_path, groups=(("a",), ("b",), ("a",)))
    run = hg.start("-c", str(ctoml), "--plan", str(pfile), "--grace", "2", "--json", "--",
                   PY, "-c", "import time; time.sleep(600)")
    pids = run.wait_all_started(3)
    os.kill(pids[1], signal.SIGKILL)
    assert run.finish() == 128 + 9
    ended = run.events()[-1]
    assert ended["event"] == "job_ended" and ended["state"] == "failed"
    cause = ended["root_cause"]
    assert (cause["node"], cause["rank"], cause["signal"], cause["exit_code"]) == ("b", 1, "SIGKILL", 137)
    assert "not by hgtrain" in cause["reason"] or "possibly out of memory" in cause["reason"]
    assert job_pids(run.job_id) == []


def test_ctrl_c_and_sigterm_stop_everything(hg, tmp_path):
    _, plan, ctoml, pfile = setup(tmp_path)
    for sig, expected in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        run = hg.start("-c", str(ctoml), "--plan", str(pfile), "--grace", "2", "--json", "--",
                       PY, "-c", "import time; time.sleep(600)")
        run.wait_all_started(3)
        run.proc.send_signal(sig)
        assert run.finish() == expected, run.stderr
        ended = run.events()[-1]
        assert ended["state"] == "stopped" and ended["exit_code"] == expected
        assert job_pids(run.job_id) == []
        assert hg.record(run.job_id)["state"] == "stopped"


def test_controller_sigkilled_leaves_the_agents_to_clean_up(hg, tmp_path):
    _, plan, ctoml, pfile = setup(tmp_path)
    run = hg.start("-c", str(ctoml), "--plan", str(pfile), "--grace", "2", "--json", "--",
                   PY, "-c", "import time; time.sleep(600)")
    run.wait_all_started(3)
    job_id = run.job_id
    assert len(rank_pids(job_id)) == 3
    run.proc.kill()
    run.finish()
    wait_until(lambda: job_pids(job_id) == [], what="the agents to stop their ranks")


def sleepers_and_agent_of_b(hg, tmp_path, *, grace: str, heartbeat_timeout: str):
    """A running 3-rank job on nodes a and b, and the pid of node b's agent."""
    _, plan, ctoml, pfile = setup(tmp_path)
    run = hg.start("-c", str(ctoml), "--plan", str(pfile), "--grace", grace, "--heartbeat-timeout",
                   heartbeat_timeout, "--json", "--", PY, "-c", "import time; time.sleep(600)")
    run.wait_all_started(3)
    return run, json.loads((hg.node_dir(run.job_id, "b") / "agent.json").read_text())["agent"]["pid"]


def test_lost_agent_fails_the_job_naming_its_node(hg, tmp_path):
    run, agent = sleepers_and_agent_of_b(hg, tmp_path, grace="2", heartbeat_timeout="5")
    os.kill(agent, signal.SIGKILL)
    assert run.finish() == 4, run.stderr
    cause = run.events()[-1]["root_cause"]
    assert cause["node"] == "b" and cause["rank"] is None and "lost" in cause["reason"]
    # node a's ranks were stopped through its agent; what b's agent left behind hgtrain stopped over
    # a fresh command (as `hgtrain stop` does)
    assert job_pids(run.job_id) == []
    notes = [e for e in run.events() if e["event"] == "notice"]
    assert any(e["node"] == "b" and "stopped what its agent left: 1 " in e["message"] for e in notes), notes


ARGS = ["$HOME", "a b", "it's", 'say "hi"', "; rm -rf /tmp/nothing", "`id`", "$(id)", "*", "line1\nline2",
        "back\\slash", "", "--json", "-c"]


def test_arguments_and_env_values_arrive_literally(hg, tmp_path):
    _, plan, ctoml, pfile = setup(tmp_path, groups=(("a",),), ps=(), nodes=("a",))
    value = "x; $(id) `id` 'q' \"d\"\nnext"
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--env", f"ODD={value}", "--json", "--",
                            PY, "-c", "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ['ODD']]))",
                            *ARGS)
    assert code == 0, err
    line = next(e["line"] for e in map(json.loads, out.splitlines()) if e["event"] == "log")
    assert json.loads(line) == [ARGS, value]


def test_secret_env_values_never_reach_logs_records_or_command_lines(hg, tmp_path):
    _, plan, ctoml, pfile = setup(tmp_path)
    secret = "s3cr3t-" + os.urandom(8).hex()
    script = ("import os, time; assert os.environ['API_TOKEN'] == os.environ['CHECK'][::-1]; "
              "assert os.environ['HGTRAIN_WANDB_KEY'] == os.environ['CHECK'][::-1]; "
              "assert os.environ['PLAIN'] == os.environ['CHECK'][::-1]; "
              "assert os.environ['DB_URL'] == 'postgres://u:' + os.environ['CHECK'][::-1] + '@db/x'; "
              "print('token ok', os.environ['HGTRAIN_JOB_TOKEN'][::-1], flush=True); time.sleep(600)")
    # from an env file and from the forwarded environment: on hgtrain's own command line (--env) a
    # value would be visible in its /proc/<pid>/cmdline before hgtrain even runs. PLAIN's name says
    # nothing (--secret-env says it); DB_URL's password is found by its shape.
    (tmp_path / "secret.env").write_text(f"API_TOKEN={secret}\nPLAIN={secret}\nDB_URL=postgres://u:{secret}@db/x\n")
    run = hg.start("-c", str(ctoml), "--plan", str(pfile), "--grace", "2", "--json", "--env-file",
                   str(tmp_path / "secret.env"), "--secret-env", "PLAIN", "--env", f"CHECK={secret[::-1]}",
                   "--", PY, "-c", script, env=hg.env(HGTRAIN_WANDB_KEY=secret))
    run.wait_all_started(3)
    run.wait_event(lambda ev: sum(e["event"] == "log" and e["line"].startswith("token ok") for e in ev) == 3)
    assert_not_in_any_cmdline(secret)     # while the job runs
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 130
    (tmp_path / "secret.env").unlink()
    seen = "\n".join(run.lines) + run.stderr + text_under(hg.state_dir, hg.home)
    assert "token ok" in seen and secret not in seen
    assert "postgres://u:<redacted>@db/x" in seen             # agent.json keeps the rest of the URL
    # The job's rendezvous secret reached every rank (the same one) and no file: only the spec carried it.
    tokens = {e["line"].split()[-1][::-1] for e in run.events() if e["event"] == "log" and "token ok" in e["line"]}
    assert len(tokens) == 1
    token = tokens.pop()
    assert len(token) == 32 and token not in seen


def test_detach_returns_at_once_and_the_agent_stop_ends_only_that_job(hg, tmp_path):
    _, plan, ctoml, pfile = setup(tmp_path)
    started = []
    for _ in range(2):
        code, out, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--detach", "--json", "--grace", "2",
                                "--", PY, "-c", "import time; time.sleep(600)")
        assert code == 0, err
        events = [strict_json(line) for line in out.splitlines()]
        assert events[-1]["event"] == "job_ended" and events[-1]["state"] == "running"
        assert events[-1]["detached"] is True
        started.append(events[-1]["job_id"])
        assert hg.record(started[-1])["state"] == "running" and hg.record(started[-1])["detached"]
        assert not list(hg.job_dir(started[-1]).glob("rank*.log"))   # the logs live on the nodes
    for job_id in started:
        wait_until(lambda: len(rank_pids(job_id)) == 3, what="the detached ranks")
    from tests.agent.harness import transport
    from hgcli.remote.transport import node_module_argv
    argv, env = node_module_argv(transport("a"), "agent", "--stop", started[0])
    done = transport("a").run(argv, env=env, timeout=120)
    assert done.exit_code == 0, done.stdout + done.stderr
    wait_until(lambda: job_pids(started[0]) == [], what="the stopped job's ranks to end")
    assert len(rank_pids(started[1])) == 3       # the other job on the same nodes runs on
    argv, env = node_module_argv(transport("a"), "agent", "--stop", started[1])
    assert transport("a").run(argv, env=env, timeout=120).exit_code == 0


def test_ranks_filter_and_plain_output(hg, tmp_path):
    _, plan, ctoml, pfile = setup(tmp_path, groups=(("a", "b"),), ps=())
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--ranks", "1", "--",
                            PY, "-c", "import os; print('hello from', os.environ['RANK'])")
    assert code == 0, err
    assert out.splitlines() == ["b:1 | hello from 1"]
    assert "succeeded (exit code 0)" in err
    job_id = hg.job_ids()[0]
    assert (hg.job_dir(job_id) / "rank0.log").read_text() == "hello from 0\n"   # all saved


def test_bad_inputs_are_refused_before_anything_starts(hg, tmp_path):
    cluster, plan, ctoml, pfile = setup(tmp_path)
    other = local_cluster(("x", "y"))
    foreign = plan_file(tmp_path / "other", make_plan(other, [["x"]])) if (tmp_path / "other").mkdir() is None else None
    code, _, err = hg.run("-c", str(ctoml), "--plan", str(foreign), "--", PY, "-c", "pass")
    assert code == 2 and "made for cluster" in err
    code, _, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--env", "1BAD=x", "--", PY, "-c", "pass")
    assert code == 2 and "--env" in err
    code, _, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--ranks", "2-1", "--", PY, "-c", "pass")
    assert code == 2 and "--ranks" in err
    code, _, err = hg.run("-c", str(ctoml), "--plan", str(pfile))
    assert code == 2 and "no command" in err
    assert hg.job_ids() == []


def test_silent_agent_is_lost_after_the_heartbeat_timeout(hg, tmp_path):
    """An agent that stops answering (SIGSTOP: like a link cut without FIN) is lost within the timeout."""
    run, agent = sleepers_and_agent_of_b(hg, tmp_path, grace="1", heartbeat_timeout="4")
    os.kill(agent, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        assert run.finish() == 4, run.stderr
        # the fresh --stop sees the agent stopped (state T) and does not wait the grace period and
        # AGENT_EXTRA_WAIT_S for it to act on SIGTERM, which it cannot until continued (waited, the
        # heartbeat timeout and that wait alone would take 4 + 1 + 15 s)
        assert time.monotonic() - frozen < 1 + AGENT_EXTRA_WAIT_S, run.stderr
        cause = run.events()[-1]["root_cause"]
        assert cause["node"] == "b" and "nothing heard from its agent" in cause["reason"]
        # hgtrain's fresh `--stop` found the frozen agent not responding and stopped its ranks itself
        wait_until(lambda: job_pids(run.job_id) == [], what="every rank to be stopped")
    finally:
        os.kill(agent, signal.SIGCONT)   # it wakes to a closed connection and exits
    wait_until(lambda: not os.path.exists(f"/proc/{agent}") or
               open(f"/proc/{agent}/stat").read().split(")")[1].split()[0] == "Z", what="the agent to exit")


FLOOD = """
import os, sys
r = os.environ['RANK']
w = sys.stdout.write
for i in range(50000):
    w(f'rank {r} line {i}\\n')
sys.stdout.write('x' * 200000 + '\\n')
sys.stdout.buffer.write(b'bad \\xff bytes\\nno newline')
"""


def test_floods_long_lines_and_bad_bytes_arrive_complete_and_in_order(hg, tmp_path):
    _, plan, ctoml, pfile = setup(tmp_path, groups=(("a", "b"),))
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--", PY, "-c", FLOOD)
    assert code == 0, err
    job_id = hg.job_ids()[0]
    for rank, node in ((0, "a"), (1, "b")):
        lines = (hg.job_dir(job_id) / f"rank{rank}.log").read_text().split("\n")
        assert lines[:50000] == [f"rank {rank} line {i}" for i in range(50000)]
        assert lines[50000:] == ["x" * 200000, "bad \\xff bytes", "no newline", ""]
        shown = [line for line in out.split("\n") if line.startswith(f"{node}:{rank} | rank")]
        assert len(shown) == 50000


def test_detached_job_is_seen_by_status_and_ended_by_stop_from_another_directory(hg, tmp_path):
    import subprocess

    _, plan, ctoml, pfile = setup(tmp_path)
    code, out, err = hg.run("-c", "cluster.toml", "--plan", str(pfile), "--detach", "--json", "--grace", "2",
                            "--", PY, "-c", "import time; print('detached rank up', flush=True); time.sleep(600)")
    assert code == 0, err
    job_id = strict_json(out.splitlines()[-1])["job_id"]
    assert hg.record(job_id)["cluster_source"] == str(ctoml)     # absolute: readable from anywhere
    wait_until(lambda: len(rank_pids(job_id)) == 3, what="the detached ranks")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def hgtrain(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "hgcli", *args], capture_output=True, text=True, env=hg.env(),
                              cwd=elsewhere, timeout=180)

    status = hgtrain("status", job_id, "--json")
    assert status.returncode == 0, status.stderr
    assert job_id in status.stdout and "running" in status.stdout
    stop = hgtrain("stop", job_id)
    assert stop.returncode == 0, stop.stderr + stop.stdout
    assert job_pids(job_id) == []
