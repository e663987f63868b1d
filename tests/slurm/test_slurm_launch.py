"""hgtrain inside a real Slurm allocation: nodes reached as job steps (srun), never over SSH.

The jobs run as users run them, ``salloc -N2 -- hgtrain launch ...``; the nodes come from
SLURM_JOB_NODELIST and the transport is auto's choice. One state directory for the module, so the
first launch's probe and bench serve the later ones (as a second launch on a cluster does).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hgcli.remote.srun import SrunTransport
from hgcli.schema.stages import NodeSpec, SrunSettings
from tests.agent.harness import job_pids
from tests.slurmcluster import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 120.0
# Short settings of the bundled example: what is tested is the launch, not the accuracy.
TRAIN = ("-m", "hgcli.examples.train", "--epochs", "1", "--train-size", "256", "--test-size", "128",
         "--eval-samples", "64", "--workers", "0", "--max-steps", "4", "--target", "0")
WHERE = "import os; print('on', os.environ['SLURMD_NODENAME'], 'step', os.environ['SLURM_STEP_ID'], flush=True)"
SLEEP = WHERE + "\nimport time; time.sleep(300)"


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slurm-home")


class Hg:
    """``hgtrain`` run under salloc (or, for stop, from a terminal outside the allocation)."""

    def __init__(self, slurm: SlurmCluster, home: Path) -> None:
        self.slurm = slurm
        self.home = home
        self.state = home / "state"
        self.procs: list[subprocess.Popen[str]] = []

    def env(self) -> dict[str, str]:
        env = self.slurm.env()
        env.update(PYTHONPATH=str(REPO), HOME=str(self.home), HGTRAIN_STATE_DIR=str(self.state))
        return env

    def salloc(self, *args: str, allocation: tuple[str, ...] = ("--nodes=2",)) -> subprocess.Popen[str]:
        # A session of its own: a failed test's teardown ends salloc and hgtrain under it together.
        proc = subprocess.Popen(["salloc", "--quiet", *allocation, "--", sys.executable, "-m", "hgcli", *args],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=self.env(), cwd=self.home, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = WAIT_S, allocation: tuple[str, ...] = ("--nodes=2",)
            ) -> tuple[int, str, str]:
        proc = self.salloc(*args, allocation=allocation)
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err

    def outside(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hgcli", *args], capture_output=True, text=True,
                              env=self.env(), cwd=self.home, timeout=WAIT_S, stdin=subprocess.DEVNULL)

    def record(self, job_id: str) -> dict:
        return json.loads((self.state / "jobs" / job_id / "job.json").read_text())

    def job_ids(self) -> list[str]:
        root = self.state / "jobs"
        return sorted(os.listdir(root)) if root.is_dir() else []


@pytest.fixture
def hg(slurm, home):
    runner = Hg(slurm, home)
    yield runner
    for proc in runner.procs:   # only a failed test leaves one running
        if proc.poll() is None:
            end_group(proc)
    slurm.wait_no_jobs()
    leaked = {job: job_pids(job) for job in runner.job_ids() if job_pids(job)}
    assert not leaked, f"processes left behind: {leaked}"
    assert not slurm.steps(), f"job steps left behind: {slurm.steps()}"


def end_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the process's session (salloc and hgtrain: it stops its job in order), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(30)
            return
        except subprocess.TimeoutExpired:
            continue


def child_of(pid: int, timeout: float = 30.0) -> int:
    """The process salloc started (hgtrain itself): Ctrl-C goes to it, not to salloc."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    stat = Path(f"/proc/{name}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    return int(name)
        time.sleep(0.05)
    raise AssertionError(f"salloc (pid {pid}) started nothing within {timeout:g} s")


def wait_events(proc: subprocess.Popen[str], count: int, kind: str = "rank_started") -> list[dict]:
    """Read --json events until ``count`` of ``kind`` arrived."""
    assert proc.stdout is not None
    seen: list[dict] = []
    deadline = time.monotonic() + WAIT_S
    for line in proc.stdout:
        seen.append(json.loads(line))
        if sum(e["event"] == kind for e in seen) >= count:
            return seen
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no {count} {kind} events; got {[e['event'] for e in seen]}; "
                         f"exit {proc.poll()}, stderr {proc.stderr.read() if proc.stderr else ''}")


def our_steps(slurm: SlurmCluster) -> list[str]:
    return [s for s in slurm.steps() if s.split()[-1].startswith("hgtrain-")]


def test_main_job_in_salloc(slurm, hg):
    """The README's main command inside ``salloc -N2``: probe, bench, plan and launch on the two
    allocated nodes, one rank each (--nproc-per-node), exit code 0 passed through salloc."""
    code, out, err = hg.run("launch", "--nproc-per-node", "1", "--", sys.executable, *TRAIN)
    assert code == 0, (out + err)[-4000:]
    assert re.search(r"\[plan\] \w+: 2 rank\(s\)", err), err[-3000:]
    assert "2 ranks on n1, n2" in err and "accuracy reached" in err, err[-3000:]
    job_id, = hg.job_ids()
    record = hg.record(job_id)
    assert record["state"] == "succeeded" and record["slurm_job"]
    # The ranks ran on the nodes' own addresses (NodeAddr), not on a name that does not resolve here.
    assert f"master {slurm.addresses['n1']}:" in err, err[-3000:]


def test_ranks_run_as_job_steps_and_a_failing_rank_is_the_exit_code(slurm, hg):
    """Each node's agent is a job step on that node (the ranks see SLURMD_NODENAME, no sshd is
    involved), and the first failing rank's exit code is salloc's."""
    # Rank 1 fails once rank 0 has said where it runs (else the stop could end rank 0 first).
    script = WHERE + """
import sys, time
ready = os.environ['READY']
if os.environ['RANK'] == '0':
    open(ready, 'w').close()
    sys.exit(0)
deadline = time.time() + 60
while not os.path.exists(ready) and time.time() < deadline:
    time.sleep(0.05)
sys.exit(3)
"""
    ready = hg.home / f"ready-{time.monotonic_ns()}"
    code, out, err = hg.run("launch", "--nproc-per-node", "1", "--grace", "2", "--env", f"READY={ready}", "--",
                            sys.executable, "-c", script)
    assert code == 3, (out + err)[-3000:]
    assert re.search(r"n1:0 \| on n1 step \d+", out) and re.search(r"n2:1 \| on n2 step \d+", out), out
    assert "root cause: n2:1 exited with code 3" in err, err[-3000:]


def test_an_sbatch_script_launches_and_its_exit_code_is_the_job_s(slurm, hg, tmp_path):
    """From a batch script (the batch step on the first node), as docs/slurm.md shows; ``sbatch
    --wait`` exits with the script's code, here a failing rank's."""
    script = tmp_path / "train.sbatch"
    output = tmp_path / "slurm.out"
    failing = WHERE + "\nimport sys; sys.exit(5 if os.environ['RANK'] == '0' else 0)"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2\n"
                      f"exec {sys.executable} -m hgcli launch --nproc-per-node 1 --grace 2 -- "
                      f"{sys.executable} -c {shlex.quote(failing)}\n")
    done = subprocess.run(["sbatch", "--wait", "--quiet", f"--output={output}", str(script)], capture_output=True,
                          text=True, env=hg.env(), cwd=hg.home, timeout=WAIT_S, stdin=subprocess.DEVNULL)
    log = output.read_text() if output.exists() else ""
    assert done.returncode == 5, done.stderr + log[-3000:]
    assert re.search(r"n1:0 \| on n1 step \d+", log) and "root cause: n1:0 exited with code 5" in log, log[-3000:]


def test_a_heterogeneous_job_reaches_each_component_s_nodes(slurm, hg):
    """``salloc -N1 -w n1 : -N1 -w n2`` (as ``#SBATCH hetjob``): no SLURM_JOB_NODELIST, one list per
    component; each node's step names its component (--het-group)."""
    code, out, err = hg.run("launch", "--nproc-per-node", "1", "--", sys.executable, "-c", WHERE,
                            allocation=("--nodes=1", "--nodelist=n1", ":", "--nodes=1", "--nodelist=n2"))
    assert code == 0, (out + err)[-3000:]
    assert "2 ranks on n1, n2" in err, err[-3000:]
    assert re.search(r"n1:0 \| on n1 step \d+", out) and re.search(r"n2:1 \| on n2 step \d+", out), out


def test_ctrl_c_leaves_no_step_behind(slurm, hg):
    proc = hg.salloc("launch", "--nproc-per-node", "1", "--grace", "2", "--json", "--", sys.executable, "-c", SLEEP)
    wait_events(proc, 2)
    assert len(our_steps(slurm)) == 2, slurm.steps()      # one agent step per node
    os.kill(child_of(proc.pid), signal.SIGINT)            # Ctrl-C reaches hgtrain, as at a terminal
    proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130
    assert not our_steps(slurm), slurm.steps()


def test_stop_from_outside_the_allocation_leaves_no_step_behind(slurm, hg):
    """``hgtrain stop`` from another terminal (no SLURM_JOB_ID there): the job's nodes are reached
    as steps of its recorded allocation; the launch ends and every step with it."""
    proc = hg.salloc("launch", "--nproc-per-node", "1", "--grace", "2", "--json", "--", sys.executable, "-c", SLEEP)
    job_id = wait_events(proc, 2)[0]["job_id"]
    status = hg.outside("status", job_id, "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["live"]["nodes"], status.stderr
    # `logs -f` tails each node's files through a step of its own, until the job ends.
    follow = subprocess.Popen([sys.executable, "-m", "hgcli", "logs", job_id, "-f"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=hg.env(), cwd=hg.home, stdin=subprocess.DEVNULL,
                              start_new_session=True)
    hg.procs.append(follow)
    assert follow.stdout is not None
    first = [follow.stdout.readline(), follow.stdout.readline()]
    assert sorted(re.sub(r"step \d+", "step N", line.strip()) for line in first) == [
        "n1:0| on n1 step N", "n2:1| on n2 step N"], first
    stop = hg.outside("stop", job_id, "--json")
    _, err = proc.communicate(timeout=WAIT_S)
    follow.communicate(timeout=WAIT_S)   # ends with the job (or with its allocation)
    assert stop.returncode == 0, stop.stdout + stop.stderr + err
    nodes = json.loads(stop.stdout)["nodes"]
    # A node whose stop step the ending allocation cut short (the launch returned once the other node
    # stopped, and salloc released the job) is confirmed by Slurm having ended everything of it.
    assert [(n["node"], n["ok"]) for n in nodes] == [("n1", True), ("n2", True)], nodes
    assert all(n["agent"] == "stopped" or n["state"] == "allocation ended" for n in nodes), nodes
    assert proc.returncode != 0 and hg.record(job_id)["state"] not in ("running", "starting"), err
    assert not our_steps(slurm), slurm.steps()


def test_srun_transport_carries_arguments_stdin_and_cancels_a_step_that_outlives_its_connection(slurm):
    """Arguments reach the node as given (no shell in between), stdin is the step's stdin, and a
    step whose command ignores stdin EOF is cancelled by scancel when the transport closes."""
    granted = slurm.command("salloc", "--nodes=2", "--no-shell", "--quiet")
    job = re.search(r"(\d+)", slurm.command("squeue", "--noheader", "--format=%i").stdout)
    assert granted.returncode == 0 and job, granted.stderr
    os.environ["SLURM_CONF"] = str(slurm.conf)   # srun, squeue and scancel of this process
    try:
        settings = SrunSettings(job_id=job.group(1), srun="srun")
        with SrunTransport(NodeSpec(name="n2", host="n2"), settings) as transport:
            odd = ["a b", "'q'", "$HOME", "x;y", ""]
            done = transport.run(["sh", "-c", 'printf "%s|" "$@"; printf "%s|" "$K"; cat; '
                                  'printf "|%s" "$SLURMD_NODENAME"', "sh", *odd],
                                 stdin=b"from stdin", env={"K": "v w"}, timeout=30)
            assert done.exit_code == 0, done.stderr
            assert done.stdout == "a b|'q'|$HOME|x;y||v w|from stdin|n2"
            stubborn = transport.start(["sh", "-c", "trap '' HUP; exec sleep 300 </dev/null"])
            deadline = time.monotonic() + 30
            while len(our_steps(slurm)) < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(our_steps(slurm)) == 1
        started = time.monotonic()
        assert stubborn.wait(15) != 0 and time.monotonic() - started < 15
        assert not our_steps(slurm), slurm.steps()
        refused = SrunTransport(NodeSpec(name="n9", host="n9"), settings)
        with pytest.raises(Exception, match="srun could not start a step there"):
            refused.run(["true"], timeout=30)
    finally:
        del os.environ["SLURM_CONF"]
        slurm.command("scancel", job.group(1))
        slurm.wait_no_jobs()


def test_transport_srun_outside_an_allocation_is_one_line_and_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-m", "hgcli", "probe", "--transport", "srun"], capture_output=True,
                          text=True, env=env, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "hgtrain: error: transport srun: not inside a Slurm allocation (SLURM_JOB_ID is not set); "
        "run hgtrain under sbatch or salloc, or use the ssh transport"]
