"""The launcher's exchange with an agent: ``prepare`` (plan file, free port) before the spec, and log
batches as raw payloads (``raw_logs``) read back with ``frames.read_stream``: exact lines, pieces of a
long line, bytes that are not UTF-8, a last line without a newline; the frames tile the files."""
from __future__ import annotations

import json
import os
import stat
import threading

from hgcli.node import frames
from hgcli.node.agent.logs import CHUNK

from .harness import WAIT_S, job_pids, new_job_id, py, transport
from hgcli.remote.transport import node_module_argv

WRITER = ("import sys\nw = sys.stdout.buffer.write\n"
          "for i in range(3000): w(b'line %d\\n' % i)\n"
          "w(b'y' * 200000 + b'\\n')\n"
          "w(b'bad \\xff bytes caf\\xc3\\xa9\\n')\n"
          "w(b'no newline at the end')\n")


def start(node: str = "n1"):
    t = transport(node)
    argv, env = node_module_argv(t, "agent")
    return t.start(argv, env=env)


def send(proc, frame) -> None:
    proc.stdin.write(frames.encode(frame).encode())
    proc.stdin.flush()


def test_prepare_then_spec_with_raw_log_frames(tmp_path):
    job, root = new_job_id(), tmp_path / "jobs"
    proc = start()
    found: list[dict] = []
    reader = threading.Thread(target=lambda: found.extend(frames.read_stream(proc.stdout)), daemon=True)
    reader.start()
    plan = json.dumps({"strategy": "allreduce", "world_size": 1})
    send(proc, {"type": "prepare", "job_id": job, "node": "n1", "jobs_root": str(root), "plan": plan, "port": True})
    send(proc, {"type": "spec", "job_id": job, "node": "n1", "jobs_root": str(root), "raw_logs": True,
                "heartbeat_timeout_s": 0, "ranks": [{"rank": 0, "argv": list(py(WRITER))}]})
    assert proc.wait(WAIT_S) == 0
    reader.join(WAIT_S)
    proc.close()
    prepared = found[0]
    assert prepared["type"] == "prepared" and 1024 <= prepared["port"] < 65536
    assert open(prepared["plan"]).read() == plan
    assert stat.S_IMODE(os.stat(prepared["plan"]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(prepared["job_dir"]).st_mode) == 0o700
    out = [f for f in found if f["type"] == "logs" and f["stream"] == "out"]
    assert all("size" not in f and isinstance(f["text"], str) for f in out)
    assert [f["offset"] for f in out] == [0] + [f["end"] for f in out[:-1]]          # they tile the file
    assert len(out) < 100                                                            # batches, not lines
    pieces = [f for f in out if f.get("partial")]
    assert len(pieces) == 200000 // CHUNK and all(len(f["text"].rsplit("\n", 1)[-1]) == CHUNK for f in pieces)
    text = "".join(f["text"] for f in out)
    expected = ("".join(f"line {i}\n" for i in range(3000)) + "y" * 200000 + "\n"
                + "bad \\xff bytes caf\u00e9\n" + "no newline at the end")
    assert text == expected
    assert out[-1]["end"] == os.path.getsize(os.path.join(prepared["job_dir"], "rank-0.out"))
    assert found[-1]["type"] == "end" and found[-1]["logs_complete"] is True
    assert job_pids(job) == []


def test_a_bad_prepare_request_is_one_error_frame(tmp_path):
    proc = start()
    send(proc, {"type": "prepare", "job_id": new_job_id(), "node": "n1", "jobs_root": str(tmp_path / "jobs"),
                "plan": "{not json", "port": False})
    out = proc.stdout.read().decode()
    assert proc.wait(WAIT_S) == 2
    proc.close()
    (error,) = [f for f in map(frames.decode, out.split("\n")) if f is not None]
    assert error["type"] == "error" and "cannot prepare the job" in error["message"]
