"""Deep but valid JSON from a rank or on disk, and state files that are not files (issue 51's audit):
each is refused or dropped where it is first read, in one line, and never reaches a recursive reader."""
from __future__ import annotations

import json
import os
import threading

import pytest

from hgcli.errors import StateError
from hgcli.node.agent.jobdir import last_metrics
from hgcli.node.agent.logs import metric_frames
from hgcli.node.agent.ranks import read_error_file
from hgcli.schema.deepjson import MAX_DEPTH, nesting
from hgcli.state import read_json

DEEP = '{"a":' * 900 + "1" + "}" * 900


def test_nesting_ignores_brackets_inside_strings():
    assert nesting('{"a": [1, {"b": "[[[{{{"}]}') == 3
    assert nesting('"\\"[[["') == 0 and nesting(DEEP) == 900


def test_a_deep_metrics_line_is_dropped_on_the_node_with_one_notice():
    """The audit's repro: this line ended `launch` in "internal error: RecursionError" and broke
    `status` for good; it killed the agent's metrics follower too."""
    make = metric_frames(1)
    frames = make(bytearray(f'{DEEP}\n{{"loss": 0.5}}\n{DEEP}\n'.encode()), 0, True, False)
    assert [f["type"].value for f in frames] == ["warning", "metric"]
    assert "nested deeper than" in frames[0]["message"] and frames[1]["data"] == {"loss": 0.5}
    assert make(bytearray(f"{DEEP}\n".encode()), 0, True, False) == []          # told once per rank
    shallow = json.dumps(json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH))
    assert make(bytearray(f'{{"x": {shallow[1:-1] or 0}}}\n'.encode()), 0, True, False)[0]["type"].value == "metric"


def test_an_error_file_of_brackets_does_not_take_the_agent_down(tmp_path):
    """200,000 `[` in TORCHELASTIC_ERROR_FILE aborted the node agent (exit -6)."""
    path = tmp_path / "error.json"
    path.write_text("[" * 200_000)
    assert read_error_file(path) is None
    path.write_text(json.dumps({"message": "ValueError: x"}))
    assert read_error_file(path) == {"message": "ValueError: x", "traceback": ""}


def test_status_last_metrics_are_strict_json(tmp_path):
    """`status --json` of a running job printed NaN: the agent's last metrics were never cleaned."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 3, "loss": NaN, "big": 1e400}\n')
    assert last_metrics(path) == {"step": 3, "loss": None, "big": None}
    path.write_text(DEEP + "\n")
    assert last_metrics(path) is None


def test_state_files_that_are_deep_or_not_files_are_refused_without_hanging(tmp_path):
    deep = tmp_path / "job.json"
    deep.write_text(DEEP)
    with pytest.raises(StateError, match="nested deeper than"):
        read_json(deep)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo, 0o600)
    seen: list[BaseException] = []
    reader = threading.Thread(target=lambda: _catch(seen, lambda: read_json(fifo)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "read_json blocked on a named pipe"
    assert isinstance(seen[0], StateError) and "not a regular file" in str(seen[0])


def _catch(seen: list[BaseException], call) -> None:
    try:
        call()
    except BaseException as exc:       # recorded for the test's thread to assert on
        seen.append(exc)
