"""Floods: a rank writing 32 MiB of random bytes or one 10 MB line must not stall or corrupt the others."""
from __future__ import annotations

import hashlib

import pytest

from hgcli.node.agent.logs import CHUNK

from .harness import job_pids, py

STEADY = ("import time\n"
          "for i in range(3000):\n"
          "    print(f'steady {i:05d} ' + 'abcdefghij' * 8, flush=True)\n"
          "    if i % 100 == 0: time.sleep(0.01)\n")


def steady_lines():
    return [f"steady {i:05d} " + "abcdefghij" * 8 for i in range(3000)]


@pytest.mark.slow
def test_random_byte_flood_does_not_block_or_corrupt_other_ranks(start_agent):
    size = 32 * 1024 * 1024     # ~130 K "lines" of random bytes: enough to outlast the steady rank
    flood = ("import hashlib, os, sys\n"
             "h = hashlib.sha256()\n"
             f"for _ in range({size} // (1 << 20)):\n"
             "    b = os.urandom(1 << 20); h.update(b); sys.stdout.buffer.write(b)\n"
             "sys.stdout.buffer.flush()\n"
             "print(h.hexdigest(), file=sys.stderr)\n")
    agent = start_agent([{"rank": 0, "argv": py(flood)}, {"rank": 1, "argv": py(STEADY)}],
                        count_only=frozenset({0}))
    end = agent.wait_type("end", timeout=280)
    assert end["state"] == "succeeded" and end["logs_complete"]
    assert agent.lines(1) == steady_lines()
    (digest,) = agent.lines(0, "err")
    data = (agent.job_dir / "rank-0.out").read_bytes()
    assert len(data) == size and hashlib.sha256(data).hexdigest() == digest
    frames_sent, _, last_end, gaps = agent.counts[(0, "out")]
    assert last_end == size and gaps == 0
    assert frames_sent < data.count(b"\n") // 100    # batches: ~130 K lines in a few hundred frames
    assert agent.wait_exit() == 0 and job_pids(agent.job_id) == []


def test_one_huge_line_arrives_in_marked_pieces(start_agent):
    size = 10 * 1024 * 1024
    huge = f"import sys\nsys.stdout.write('0123456789' * {size // 10} + '\\n')\nprint('after')\n"
    agent = start_agent([{"rank": 0, "argv": py(huge)}, {"rank": 1, "argv": py(STEADY)}])
    end = agent.wait_type("end", timeout=120)
    assert end["state"] == "succeeded"
    pieces = [f for f in agent.of_type("logs") if f["rank"] == 0 and f["stream"] == "out"]
    # 159 pieces of 64 KiB, each alone in its frame, marked partial; then the last 64 KiB with its
    # newline, and "after" (in one frame or two, depending on when the agent read them)
    cut = [f for f in pieces if f.get("partial")]
    assert pieces[:len(cut)] == cut and len(cut) == size // CHUNK - 1
    assert all("\n" not in f["text"] and f["end"] - f["offset"] == CHUNK for f in cut)
    assert [f["offset"] for f in pieces[1:]] == [f["end"] for f in pieces[:-1]]   # they tile the file
    assert agent.lines(0) == ["0123456789" * (size // 10), "after"]
    assert agent.lines(1) == steady_lines()
    assert agent.wait_exit() == 0
