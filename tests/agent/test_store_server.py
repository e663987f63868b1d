"""The job's store served by hgtrain (hgcli/node/store), as the agent runs it: a child process
(``python -S -m hgcli.node.agent.store FD``), its admission rule on stdin. torch's own client speaks to
it, on both of its paths (``use_libuv`` True and False); raw bytes show what it closes."""
from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .harness import py

REPO = Path(__file__).resolve().parents[2]
MAGIC = struct.pack("=I", 0x3C85F7CE)

# Every query torch 2.13's client can send, through TCPStore's Python methods; one line of results.
OPS = r"""
import datetime, json, sys
import torch.distributed as dist
port, out = int(sys.argv[1]), {}
for libuv in (True, False):
    s = dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=libuv, timeout=datetime.timedelta(seconds=20))
    p, r = f"{int(libuv)}/", []
    s.set(p + "a", "x"); r.append(s.get(p + "a").decode())
    r += [s.add(p + "n", 3), s.add(p + "n", -1), s.get(p + "n").decode()]
    r += [s.compare_set(p + "c", "", "v1").decode(), s.compare_set(p + "c", "zz", "v2").decode(),
          s.compare_set(p + "c", "v1", "v2").decode(), s.compare_set(p + "m", "zz", "v").decode()]
    r += [s.check([p + "a", p + "n"]), s.check([p + "a", p + "nope"])]
    try:
        s.wait([p + "nope"], datetime.timedelta(milliseconds=100))
        r.append("no timeout")
    except dist.DistStoreError:
        r.append("timed out")
    s.set(p + "nope", "now"); s.wait([p + "nope"]); r.append(s.get(p + "nope").decode())   # usable after a cancel
    s.append(p + "ap", "x"); s.append(p + "ap", "y"); r.append(s.get(p + "ap").decode())
    s.multi_set([p + "m1", p + "m2"], ["1", "2"]); r.append([v.decode() for v in s.multi_get([p + "m1", p + "m2"])])
    r += [s.delete_key(p + "a"), s.delete_key(p + "a")]
    s.barrier(p + "bar", 1, datetime.timedelta(seconds=5)); r.append(s.get(p + "bar").decode())
    if libuv:   # torch's classic client path refuses queues itself
        s.queue_push(p + "q", "i1"); s.queue_push(p + "q", "i2")
        r += [s.queue_len(p + "q"), s.queue_pop(p + "q").decode(), s.queue_pop(p + "q", block=False).decode()]
        try:
            s.queue_pop(p + "q", block=False)
        except dist.QueueEmptyError:
            r.append("empty")
    r += [s.num_keys(), sorted(k for k in s.list_keys() if k.startswith(p))]
    out[p] = r
print(json.dumps(out), flush=True)
"""


class StoreChild:
    """The store's process on a fresh loopback port, as StoreHost starts it."""

    def __init__(self, peers: dict) -> None:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            self.port = listener.getsockname()[1]
            self.started = time.monotonic()
            self.proc = subprocess.Popen(
                [sys.executable, "-S", "-m", "hgcli.node.agent.store", str(listener.fileno())],
                pass_fds=(listener.fileno(),), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(peers).encode() + b"\n")
        self.proc.stdin.flush()
        self.first_line = self.proc.stdout.readline().decode()

    def stop(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()   # the agent's end of the pipe: EOF stops the store
        rest = self.proc.stdout.read().decode()
        assert self.proc.wait(10) == 0, rest
        return rest

    def raw(self, *queries: bytes) -> bytes:
        """Send torch's bytes and read what comes back until the store closes the connection."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            s.sendall(b"".join(queries))
            s.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := s.recv(4096):
                got += chunk
        return got


@pytest.fixture
def store():
    child = StoreChild({"uid": os.geteuid(), "addresses": []})
    yield child
    if child.proc.poll() is None:
        child.proc.kill()
        child.proc.wait(10)


def test_torch_s_client_gets_every_query_answered_on_both_paths(store):
    # Up and serving without torch: in well under the second torch's import takes.
    assert store.first_line.startswith(f"serving the job's store on 127.0.0.1:{store.port} to uid {os.geteuid()}")
    assert time.monotonic() - store.started < 2.0
    done = subprocess.run(py(OPS) + [str(store.port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    common = ["x", 3, 2, "2", "v1", "v1", "v2", "zz", True, False, "timed out", "now", "xy", ["1", "2"], True,
              False, "1"]
    assert results["1/"] == common + [2, "i1", "i2", "empty", 7,
                                      sorted(f"1/{k}" for k in ("ap", "bar", "c", "m1", "m2", "n", "nope"))]
    assert results["0/"] == common + [7 + 7,
                                      sorted(f"0/{k}" for k in ("ap", "bar", "c", "m1", "m2", "n", "nope"))]
    assert "admitted 2 connection(s); refused: none" in store.stop()


def test_bytes_torch_never_sends_close_that_connection_only(store):
    ping = b"\x0d" + struct.pack("=I", 4242)
    assert store.raw(b"\x00" + MAGIC, ping) == struct.pack("=I", 4242)
    assert store.raw(ping) == b""                                     # no VALIDATE first
    assert store.raw(b"\x00" + struct.pack("=I", 1), ping) == b""     # a wrong magic number
    assert store.raw(b"\x00" + MAGIC, b"\x63") == b""                 # an unknown query
    assert store.raw(b"\x00" + MAGIC, b"\x03" + struct.pack("=Q", 1 << 40)) == b""   # a 1 TiB key
    # The store went on: a key set now is there.
    key = b"\x01" + struct.pack("=Q", 1) + b"k" + struct.pack("=Q", 2) + b"ok"
    get = b"\x03" + struct.pack("=Q", 1) + b"k"
    assert store.raw(b"\x00" + MAGIC, key, get) == struct.pack("=Q", 2) + b"ok"
    log = store.stop()
    assert "closed a client's connection: a client that did not begin with torch's VALIDATE" in log
    assert "unknown query type 99" in log and "a key of 1099511627776 bytes" in log
    assert log.count("did not begin with torch's VALIDATE") == 1     # two such clients, one line
