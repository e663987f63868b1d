"""The transport for the nodes of the Slurm allocation hgtrain runs in: job steps, no SSH.

Every command on a node (probe, bench, an agent, ``agent --stop``) is one job step of the allocation:
``srun --jobid=JOB --nodes=1 --ntasks=1 --nodelist=NODE --overlap ... -- env K=V ARGV``.
srun runs ARGV with no shell in between, so every argument reaches the node exactly as given (the
quoting the SSH transport needs does not arise), and it carries the step's stdin, stdout and stderr
as an SSH channel does: the agent's lifeline (it dies on stdin EOF) works unchanged. The flags, for
Slurm 22.05 and later:

- ``--overlap``: a step shares the CPUs, memory and GPUs of the job with every other step; without it a
  second step (bench beside a probe, ``hgtrain stop`` beside the running job) waits for resources
  the first one holds, and inside an sbatch script the batch step itself holds them.
- no ``--exact``: a step then gets all of the job's CPUs and memory on its node (srun's default since
  21.08) and all of its GPUs (the default for a step that asks for no GRES), so the agent's ranks are
  not confined to the one CPU a one-task step would ask for.
- ``--cpu-bind=none``, ``--mpi=none``: the agent places its ranks itself; no PMI set-up to wait for.
- ``--kill-on-bad-exit=1``, ``--unbuffered``, ``--quiet``: no step outlives a failed task; the agent's
  frames arrive as it writes them; srun's own progress lines never mix into a node's stderr.
- ``--export=ALL``: the step sees the controller's environment, as a local subprocess does.
- ``--job-name=hgtrain-<token>``: how the steps this transport started are found again in
  ``squeue --steps`` and cancelled (``scancel JOB.STEP``) when one does not end with its connection.

Secrets never travel on these command lines: the launcher sends them to its agent over stdin.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import RemoteError
from ..schema.stages import NodeSpec, SrunSettings
from .local import LocalProcess
from .transport import Completed

# A step whose connection was closed (its agent saw stdin EOF) normally ends within a second or two;
# one still running after this long is cancelled.
END_WAIT_S = 5.0
# squeue and scancel ask slurmctld: bounded, like every wait here.
SLURM_COMMAND_S = 15.0
# srun's words when it made no step at all (a node not in the job, a job that has ended).
SRUN_REFUSALS = ("Unable to create step", "Unable to confirm allocation", "Invalid job id",
                 "Invalid node name")


def step_argv(settings: SrunSettings, node: NodeSpec, name: str, argv: Sequence[str],
              env: Mapping[str, str] | None = None) -> list[str]:
    """The srun command line that runs ``argv`` (with ``env`` set) as one step on ``node``."""
    assignments = [f"{k}={v}" for k, v in (env or {}).items()]
    group = dict(settings.het_groups).get(node.host)
    het = [] if group is None else [f"--het-group={group}"]   # a component's node: name the component
    return [settings.srun, f"--jobid={settings.job_id}", *het, "--nodes=1", "--ntasks=1",
            f"--nodelist={node.host}", "--overlap", "--cpu-bind=none", "--mpi=none",
            "--kill-on-bad-exit=1", "--unbuffered", "--quiet", "--export=ALL", f"--job-name={name}",
            "--", "env", *assignments, *argv]


def slurm_tool(settings: SrunSettings, tool: str) -> str:
    """squeue or scancel from srun's directory when srun was given as a path, else from PATH."""
    parent = Path(settings.srun).parent
    return str(parent / tool) if settings.srun != Path(settings.srun).name else tool


def _ask_slurm(settings: SrunSettings, argv: Sequence[str]) -> str | None:
    """stdout of a Slurm query (squeue, sinfo), None when it cannot be asked (bounded)."""
    try:
        done = subprocess.run([slurm_tool(settings, argv[0]), *argv[1:]], capture_output=True, text=True,
                              timeout=SLURM_COMMAND_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def job_nodelists(settings: SrunSettings) -> list[str]:
    """The running job's node lists in Slurm's compressed form (``squeue --jobs``), one per component
    of a heterogeneous job; [] when the job is not running (ended, or never known)."""
    out = _ask_slurm(settings, ["squeue", "--noheader", f"--jobs={settings.job_id}", "--states=RUNNING",
                                "--format=%N"])
    return [line.strip() for line in (out or "").splitlines() if line.strip()]


def node_addresses(settings: SrunSettings, hosts: Sequence[str]) -> dict[str, str]:
    """Each node's NodeAddr as Slurm knows it (``sinfo``): where its peers reach its ranks, which
    the node's name need not resolve to. Empty when sinfo cannot say."""
    out = _ask_slurm(settings, ["sinfo", "--noheader", "--Node", f"--nodes={','.join(hosts)}", "--format=%N %o"])
    found = {}
    for line in (out or "").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] in hosts:
            found[fields[0]] = fields[1]
    return found


def step_ids(settings: SrunSettings, names: Sequence[str]) -> list[str]:
    """``JOB.STEP`` of this job's running steps named in ``names`` (``squeue --steps``)."""
    out = _ask_slurm(settings, ["squeue", "--noheader", "--steps", f"--jobs={settings.job_id}", "--format=%i %j"])
    wanted = set(names)
    return [fields[0] for fields in (line.split() for line in (out or "").splitlines())
            if len(fields) == 2 and fields[1] in wanted]


def cancel_steps(settings: SrunSettings, names: Sequence[str]) -> list[str]:
    """``scancel`` every running step of the job named in ``names``; the step ids cancelled."""
    ids = step_ids(settings, names)
    if ids:
        try:
            subprocess.run([slurm_tool(settings, "scancel"), "--quiet", *ids], capture_output=True,
                           timeout=SLURM_COMMAND_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return ids


class SrunProcess(LocalProcess):
    """One step's srun, its pipes the step's stdin, stdout and stderr. Closing them is the agent's
    stdin EOF through srun (the lifeline), as closing a local agent's pipes is."""

    def __init__(self, popen: subprocess.Popen[bytes], name: str) -> None:
        super().__init__(popen)
        self.name = name   # its --job-name, by which squeue finds the step

    def running(self) -> bool:
        return self._popen.poll() is None

    def kill(self) -> None:
        try:
            self._popen.kill()
        except OSError:
            pass


class SrunTransport:
    """The ``Transport`` protocol over Slurm job steps of the allocation hgtrain runs in."""

    def __init__(self, node: NodeSpec, settings: SrunSettings) -> None:
        self.node = node
        self.settings = settings
        self._started: list[SrunProcess] = []

    def _name(self) -> str:
        return f"hgtrain-{os.urandom(6).hex()}"

    def _popen(self, argv: Sequence[str], env: Mapping[str, str] | None, name: str) -> subprocess.Popen[bytes]:
        command = step_argv(self.settings, self.node, name, argv, env)
        try:
            # A session of its own: Ctrl-C at the terminal reaches the controller only, which stops
            # the job in order; srun given SIGINT would print its step status instead of ending.
            return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            raise RemoteError(self.node.name, f"cannot run {self.settings.srun}: {exc.strerror}") from exc

    def run(self, argv: Sequence[str], *, stdin: bytes | None = None,
            env: Mapping[str, str] | None = None, timeout: float) -> Completed:
        name = self._name()
        popen = self._popen(argv, env, name)
        try:
            out, err = popen.communicate(stdin or b"", timeout=timeout)
        except subprocess.TimeoutExpired:
            cancel_steps(self.settings, [name])
            popen.kill()
            popen.communicate()
            raise RemoteError(self.node.name, f"timed out after {timeout:g} s running {argv[0]} "
                                              f"(its step was cancelled)") from None
        stderr = err.decode("utf-8", "replace")
        if popen.returncode != 0 and not out and _srun_refused(stderr):
            raise RemoteError(self.node.name, f"srun could not start a step there: {_srun_refused(stderr)}")
        return Completed(popen.returncode, out.decode("utf-8", "replace"), stderr)

    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> SrunProcess:
        name = self._name()
        process = SrunProcess(self._popen(argv, env, name), name)
        self._started.append(process)
        return process

    def package_root(self) -> str:
        # The controller's own copy, by its path: the nodes of an allocation share the file system
        # the job was submitted from (docs/slurm.md), so nothing needs shipping, and the content-
        # addressed copy the SSH transport ships would be one more step per node and command.
        return str(Path(__file__).resolve().parents[2])

    def close(self) -> None:
        """End the steps this transport started: their connections close (the lifeline), and a step
        still running after END_WAIT_S is cancelled with scancel, its srun killed."""
        started, self._started = self._started, []
        for process in started:
            process.close()
        deadline = time.monotonic() + END_WAIT_S
        for process in started:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                pass
        left = [p for p in started if p.running()]
        if left:
            cancel_steps(self.settings, [p.name for p in left])
            for process in left:
                try:
                    process.wait(END_WAIT_S)
                except TimeoutError:
                    process.kill()

    def __enter__(self) -> "SrunTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _srun_refused(stderr: str) -> str | None:
    """srun's own error line when it could not create the step at all (no such node in the job, the
    job ended), as opposed to the command failing on the node."""
    for line in stderr.splitlines():
        if line.startswith("srun: error:") and any(words in line for words in SRUN_REFUSALS):
            return line[len("srun: error:"):].strip()
    return None

