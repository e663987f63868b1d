"""The embedded cluster benched once for the session (``hgtrain bench --json --quick``, the default
model at every quick size): tests/integration/test_bench_local.py checks that bench, and the clean
venv's main job (test_clean_venv.py) launches on its stored profiles instead of a bench of its own."""
from __future__ import annotations

import pytest

from tests.stored import Benched, probe_and_bench


@pytest.fixture(scope="session")
def embedded_cluster_benched(tmp_path_factory) -> Benched:
    return probe_and_bench(None, tmp_path_factory.mktemp("embedded") / "state", "--json")
