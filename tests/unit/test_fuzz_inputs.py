"""Fuzzing the inputs hgtrain reads from files, flags and ranks (issue 51's goal): plan files, hostfiles,
Slurm node lists with any digits, ``--ranks`` and metric lines. Each either parses or is refused with
hgtrain's own error (exit 2 or 5, one line); never another exception, and never a hang (hypothesis's
deadline bounds each example: 10 s, far above any parse, so a loaded machine does not trip it). The cluster file has its own fuzz test in test_config.py."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hgcli.config.nodelists import expand_nodelist, parse_hostfile
from hgcli.config.ranklist import MAX_RANK, parse_rank_list
from hgcli.errors import ConfigError, HgError
from hgcli.launch.metrics import RecordIntake
from hgcli.node.agent.logs import metric_frames
from hgcli.plan.files import load_plan
from hgcli.schema.stages import Cluster, NodeSpec

FAST = settings(max_examples=150, deadline=10_000, suppress_health_check=[HealthCheck.too_slow])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)
PLAN_KEYS = ("strategy", "world_size", "groups", "ranks", "global_batch", "cluster", "ps_shards", "version")


def one_line(exc: HgError) -> None:
    assert exc.exit_code in (2, 5) and "\n" not in str(exc), exc


def parsed(parse, text):
    """``parse(text)``, or None where it refused in one line (any other exception fails the test)."""
    try:
        return parse(text)
    except HgError as exc:
        one_line(exc)
        return None


@FAST
@given(st.dictionaries(st.sampled_from(PLAN_KEYS), JSON, max_size=8) | JSON)
def test_plan_files_load_or_are_refused_in_one_line(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(json.dumps(data))
        try:
            load_plan(path, Cluster(nodes=(NodeSpec("n0", "localhost"),)))
        except ConfigError as exc:
            one_line(exc)
            assert str(exc).startswith(str(path)), exc


@FAST
@given(st.text(alphabet="ab01 \t=#\n²٣slotsmax_", max_size=40))
def test_hostfiles_parse_or_are_refused_in_one_line(text):
    entries = parsed(lambda t: parse_hostfile(t, "hosts"), text)
    assert entries is None or all(e.host and (e.slots is None or e.slots >= 1) for e in entries)
    # "slots=٣" was read as 3 once
    assert entries is None or all(e.slots is None or f"slots={e.slots}" in text for e in entries)


@FAST
@given(st.text(alphabet="ab01-[],²٣9", max_size=24))
def test_slurm_lists_with_any_digits_expand_or_are_refused(text):
    hosts = parsed(expand_nodelist, text)
    assert hosts is None or (hosts and text.isascii())     # "n[0-٣]" once expanded to n0..n3


@FAST
@given(st.text(alphabet="0123456789-, ²٣a", max_size=30))
def test_rank_lists_parse_within_bounds_or_are_refused(text):
    ranks = parsed(parse_rank_list, text)
    assert ranks is None or (ranks and max(ranks) <= MAX_RANK)


@FAST
@given(st.lists(st.binary(max_size=60) | JSON.map(lambda v: json.dumps(v).encode()), max_size=6))
def test_metric_lines_become_frames_and_records_stay_strict_json(lines):
    frames = metric_frames(0)(bytearray(b"\n".join(lines) + b"\n"), 0, True, False)
    intake = RecordIntake()
    for frame in frames:
        if frame["type"].value == "metric":
            data, _ = intake.take(0, frame["data"])
            json.dumps(data, allow_nan=False)           # what --json and the record store print
