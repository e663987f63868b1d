"""The job's store, served by the agent of rank 0's node (node/agent/store.py): bound to MASTER_ADDR
only from ``prepare`` on, the ranks its clients (``TORCHELASTIC_USE_AGENT_STORE=True``), ended with
the job; a store that dies stops the job and is named as the cause. Real agents, a real TCPStore,
real processes killed for real."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

from hgcli.node import frames

from .harness import WAIT_S, job_pids, new_job_id, py, store_pid, wait_until
from .test_agent_prepare import send, start

PLAN = json.dumps({"strategy": "allreduce", "world_size": 2})
# A rank that joins through torch's own env:// code path, as a plain init_process_group() script does.
CLIENT = ("import datetime, os, sys\n"
          "from torch.distributed.rendezvous import rendezvous\n"
          "store, rank, world = next(rendezvous('env://', timeout=datetime.timedelta(seconds=60)))\n"
          "r = int(os.environ['RANK'])\n"
          "store.set(f'hello/{r}', 'x')\n"
          "store.wait([f'hello/{1 - r}'])\n"
          "print('met', 1 - r, flush=True)\n"
          "if len(sys.argv) > 1: import time; time.sleep(600)\n")


def listeners(port: int) -> list[str]:
    lines = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [line.split()[3] for line in lines if line.split()[3].rsplit(":", 1)[1] == str(port)]


def out_lines(found: list[dict]) -> list[str]:
    return [line for f in list(found) if f["type"] == "logs" for line in f["text"].splitlines()]


def rank_spec(job: str, root: Path, port: int, *extra: str) -> dict:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return {"type": "spec", "job_id": job, "node": "n1", "jobs_root": str(root), "heartbeat_timeout_s": 0,
            "grace_s": 2, "ranks": [{"rank": r, "argv": [*py(CLIENT), *extra], "env": {**env, "RANK": str(r)}}
                                    for r in (0, 1)]}


class Agent:
    def __init__(self) -> None:
        self.proc = start()
        self.found: list[dict] = []
        self.reader = threading.Thread(target=lambda: self.found.extend(frames.read_stream(self.proc.stdout)),
                                       daemon=True)
        self.reader.start()

    def prepare(self, job: str, root: Path, address: str) -> dict:
        send(self.proc, {"type": "prepare", "job_id": job, "node": "n1", "jobs_root": str(root), "plan": PLAN,
                         "port": True, "address": address})
        return wait_until(lambda: next((f for f in self.found if f["type"] in ("prepared", "error")), None),
                          what="the prepared frame")

    def end(self) -> int:
        code = self.proc.wait(WAIT_S)
        self.reader.join(WAIT_S)
        self.proc.close()
        return code


def test_the_store_listens_on_master_addr_from_prepare_on_and_ends_with_the_job(tmp_path):
    job, root = new_job_id(), tmp_path / "jobs"
    agent = Agent()
    port = agent.prepare(job, root, "127.0.0.1")["port"]
    # Held before the spec comes: no window in which another process could take the port.
    assert listeners(port) == [f"127.0.0.1:{port}"]
    send(agent.proc, rank_spec(job, root, port))
    assert agent.end() == 0, agent.found[-3:]
    assert sorted(out_lines(agent.found)) == ["met 0", "met 1"]   # each rank saw the other's key
    assert agent.found[-1]["type"] == "end" and agent.found[-1]["state"] == "succeeded"
    assert job_pids(job) == [] and listeners(port) == []


def test_a_store_that_dies_stops_the_job_and_is_named_as_the_cause(tmp_path):
    job, root = new_job_id(), tmp_path / "jobs"
    agent = Agent()
    port = agent.prepare(job, root, "127.0.0.1")["port"]
    send(agent.proc, rank_spec(job, root, port, "sleep"))
    wait_until(lambda: len(out_lines(agent.found)) == 2, what="both ranks to meet")
    pid = wait_until(lambda: store_pid(job), what="the store process")
    os.kill(pid, signal.SIGKILL)
    assert agent.end() == 1
    (stopping,) = [f for f in agent.found if f["type"] == "stopping"]
    assert stopping["failed"] is True
    assert stopping["reason"].startswith(f"the job's rendezvous store on 127.0.0.1:{port} exited with code -9")
    end = agent.found[-1]
    assert end["type"] == "end" and end["state"] == "failed" and end["first_failure"] is None
    assert {f["state"] for f in agent.found if f["type"] == "exit"} == {"stopped"}
    assert job_pids(job) == []


def test_an_address_this_node_does_not_hold_is_one_error_frame(tmp_path):
    agent = Agent()
    error = agent.prepare(new_job_id(), tmp_path / "jobs", "198.51.100.7")   # TEST-NET-2
    assert agent.end() == 2
    assert error["type"] == "error"
    assert error["message"].startswith("cannot prepare the job: cannot listen on MASTER_ADDR 198.51.100.7 "
                                       "on this node: ")
