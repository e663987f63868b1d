"""The agent's pure pieces: secret names, line splitting, offsets, process identity."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from hgcli.node.agent import procs
from hgcli.node.agent.control import parse_offsets
from hgcli.node.agent.logs import CHUNK, split_batches, split_lines
from hgcli.node.agent.secrets import REDACTED, is_secret_name, redact_env
from hgcli.node.agent.spec import parse_spec


@pytest.mark.parametrize("name", ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "db_password", "WANDB_API_KEY",
                                  "GH_AUTH", "MY_PASSWD"])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["PATH", "NCCL_DEBUG", "MASTER_ADDR", "PYTHONPATH", "RANK"])
def test_plain_names(name):
    assert not is_secret_name(name)


def test_redact_env_hides_named_and_listed_values():
    assert redact_env({"HF_TOKEN": "x", "DB_URL": "y", "RANK": "0"}, ["DB_URL"]) == \
        {"HF_TOKEN": REDACTED, "DB_URL": REDACTED, "RANK": "0"}


def test_redact_env_hides_url_passwords_whatever_the_name():
    """``DB_URL=postgres://u:pass@...`` used to land in agent.json as it was."""
    env = {"DB_URL": "postgres://u:p@ss%2Fw@db:5432/x", "CACHE": "redis://:pw@r/0",
           "MIRRORS": "https://a:1@x https://y/z", "SITE": "http://host:8080/u:p@x", "PLAIN": "a:b@c"}
    assert redact_env(env) == {"DB_URL": f"postgres://u:{REDACTED}@db:5432/x", "CACHE": f"redis://:{REDACTED}@r/0",
                               "MIRRORS": f"https://a:{REDACTED}@x https://y/z", "SITE": "http://host:8080/u:p@x",
                               "PLAIN": "a:b@c"}


def test_split_lines_keeps_the_unfinished_line_and_reports_offsets():
    buf = bytearray(b"one\ntwo\nthr")
    assert list(split_lines(buf, 100, final=False)) == [(b"one", 104, False), (b"two", 108, False)]
    assert buf == b"thr"
    assert list(split_lines(buf, 108, final=True)) == [(b"thr", 111, False)]
    assert buf == b""


def test_split_lines_marks_only_an_unterminated_end_as_open():
    assert list(split_lines(bytearray(b"a\nb"), 0, final=True, open_end=True)) == [(b"a", 2, False), (b"b", 3, True)]
    assert list(split_lines(bytearray(b"a\n"), 0, final=True, open_end=True)) == [(b"a", 2, False)]


def test_split_lines_cuts_long_lines_on_character_boundaries():
    line = ("\u20ac" * CHUNK).encode()   # 3-byte characters: CHUNK is not a multiple of 3
    pieces = list(split_lines(bytearray(line + b"\n"), 0, final=False))
    assert all(p[2] for p in pieces[:-1]) and not pieces[-1][2]
    assert all(len(p[0]) <= CHUNK for p in pieces)
    assert "".join(p[0].decode("utf-8") for p in pieces) == "\u20ac" * CHUNK   # each piece decodes alone
    assert pieces[-1][1] == len(line) + 1


def test_offsets_round_trip_and_bad_ones_are_refused():
    assert parse_offsets("0:out=12,3:err=0") == {(0, "out"): 12, (3, "err"): 0}
    assert parse_offsets(None) == {}
    with pytest.raises(ValueError):
        parse_offsets("0:metrics=1")


def test_spec_errors_never_echo_env_values():
    with pytest.raises(ValueError) as err:
        parse_spec({"type": "spec", "job_id": "j", "node": "n", "env": {"TOKEN": 12345678},
                    "ranks": [{"rank": 0, "argv": ["x"]}]})
    assert "12345678" not in str(err.value) and "TOKEN" in str(err.value)


def test_signal_refuses_a_process_whose_start_time_differs():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        real = procs.proc_stat(child.pid)
        assert real is not None
        impostor = procs.ProcStat(real.pid, real.state, real.ppid, real.pgid, real.sid, real.start_ticks + 1)
        assert procs.send_signal(impostor, signal.SIGKILL) is False
        assert child.poll() is None
        assert procs.send_signal(real, signal.SIGKILL) is True
        assert child.wait(30) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait(30)
