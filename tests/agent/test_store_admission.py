"""The audit's repro (issue 51, finding 1), against a real agent's store while its job runs: another
user of the machine (uid 65534), with torch's own client and with torch's bytes, neither lists, reads
nor writes a key (the store closes its connection before reading a byte), while the job's two ranks
meet through the same store in a gloo process group, all-reduce and finish. store.log names the
refused kind of peer once, however often it came back."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from .harness import WAIT_S, new_job_id, py, wait_until
from .test_agent_prepare import send
from .test_agent_store import Agent, out_lines

SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")

RANK = ("import datetime, os, sys, time\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))   # env://, the agent's store\n"
        "print('joined', flush=True)\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.05)\n"
        "t = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(t); dist.barrier()\n"
        "store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False)\n"
        "print('sum', int(t.item()), 'intruder key', store.check(['intruder']), flush=True)\n"
        "dist.destroy_process_group()\n")

# Another user: torch imported first, then (on a line from the test) the attempts.
INTRUDER = r"""
import datetime, json, socket, struct, sys
import torch.distributed as dist
port = int(sys.argv[1])
sys.stdin.readline()
def raw(query):
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(b"\x00" + struct.pack("=I", 0x3C85F7CE) + query)   # VALIDATE, as torch's client begins
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(4096):
                got += chunk
        except OSError:   # reset, broken pipe, not connected: the store closed it first, as it should
            pass
    return got.hex()
key = struct.pack("=Q", 8) + b"intruder"
out = {"list_keys": raw(b"\x11"), "get": raw(b"\x03" + key), "set": raw(b"\x01" + key + struct.pack("=Q", 1) + b"x")}
try:
    dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2)).list_keys()
    out["torch"] = "listed"
except Exception as exc:
    out["torch"] = type(exc).__name__
print(json.dumps(out), flush=True)
"""


def test_another_user_cannot_use_a_running_job_s_store_while_its_ranks_go_on(tmp_path):
    if os.geteuid() != 0 or not SYSTEM_PYTHON.exists():
        pytest.skip("needs root (to run as uid 65534) and a system Python that uid 65534 can run")
    job, root, go = new_job_id(), tmp_path / "jobs", tmp_path / "go"
    agent = Agent()
    port = agent.prepare(job, root, "127.0.0.1")["port"]
    intruder = subprocess.Popen([str(SYSTEM_PYTHON), "-S", "-c", INTRUDER, str(port)], user=65534, group=65534,
                                cwd="/", env={"PYTHONPATH": sysconfig.get_paths()["purelib"]},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "GLOO_SOCKET_IFNAME": "lo"}
    send(agent.proc, {"type": "spec", "job_id": job, "node": "n1", "jobs_root": str(root), "heartbeat_timeout_s": 0,
                      "grace_s": 2, "ranks": [{"rank": r, "argv": [*py(RANK), str(go)], "env": {**env, "RANK": str(r)}}
                                              for r in (0, 1)]})
    wait_until(lambda: out_lines(agent.found).count("joined") == 2, what="both ranks to join")
    out, err = intruder.communicate("now\n", timeout=WAIT_S)
    assert intruder.returncode == 0, err[-2000:]
    assert json.loads(out) == {"list_keys": "", "get": "", "set": "", "torch": "DistNetworkError"}
    go.touch()
    assert agent.end() == 0, agent.found[-3:]
    assert out_lines(agent.found).count("sum 3 intruder key False") == 2
    log = (root / job / "n1" / "store.log").read_text()
    assert log.count("refused a connection from a process of uid 65534 on this machine") == 1, log
