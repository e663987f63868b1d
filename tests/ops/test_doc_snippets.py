"""Every shell snippet of the docs (``sh``/``bash``/``shell`` fences in README.md and docs/*.md) runs,
as written, in a sandbox a CI job would have: ``hgtrain``, ``python`` and ``jq`` on PATH, the
``ci/cluster.toml`` and ``train.py`` the snippets name, a stored probe and bench of that cluster (so a
plan costs no bench), a HOME of its own. A snippet that cannot run here (it needs SSH nodes, takes
minutes, installs packages) says so in the markdown, on the line before its fence:
``<!-- doc-test: skip (why) -->``; it is skipped with that reason, and nothing else is.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from hgcli import state
from hgcli.config.cluster import load_cluster
from hgcli.schema.stages import to_dict
from tests.unit.plan_clusters import A100, cluster

REPO = Path(__file__).resolve().parents[2]
SHELLS = ("sh", "bash", "shell")
SKIP = re.compile(r"<!--\s*doc-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")


@dataclass(frozen=True)
class Snippet:
    where: str             # "docs/ci.md:55", the line of its opening fence
    code: str
    skip: str | None       # the reason in its doc-test marker


def snippets() -> list[Snippet]:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = path.read_text(encoding="utf-8").split("\n")
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if m["lang"] in SHELLS:
                marker = SKIP.search(lines[i - 1]) if i else None
                found.append(Snippet(f"{path.relative_to(REPO)}:{i + 1}", "\n".join(lines[i + 1:end]) + "\n",
                                     marker["why"] if marker else None))
            i = end + 1
    return found


SNIPPETS = snippets()

CLUSTER_TOML = """\
[[nodes]]
name = "ci-node"
host = "localhost"
python = {python}
emulate = {{ devices = ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB"], speed = [1.0, 1.0], memory_mib = [40960, 40960] }}
"""
TRAIN_PY = "import os\nprint('trained on rank', os.environ['RANK'])\n"


@pytest.fixture
def sandbox(tmp_path, monkeypatch, node_home, started_jobs):
    """A CI job's working directory; its state directory (``$PWD/.hgtrain``, as docs/ci.md sets it)
    holds a fresh probe and bench of ``ci/cluster.toml``. Jobs a snippet started are stopped after
    it and must leave no process behind (``started_jobs``)."""
    work = tmp_path / "work"
    (work / "ci").mkdir(parents=True)
    ctoml = work / "ci" / "cluster.toml"
    ctoml.write_text(CLUSTER_TOML.format(python=f'"{sys.executable}"'))
    ctoml.chmod(0o600)
    (work / "train.py").write_text(TRAIN_PY)
    monkeypatch.setenv("HGTRAIN_STATE_DIR", str(work / ".hgtrain"))
    fingerprint = load_cluster(ctoml).fingerprint()
    inventory, profiles = cluster([[A100, A100]], fingerprint=fingerprint, names=["ci-node"])
    folder = state.cluster_dir(fingerprint)
    state.write_json(folder / "inventory.json", to_dict(replace(inventory, probed_at=time.time())))
    state.write_json(folder / "profiles.json", to_dict(profiles))
    bin_dir = Path(sys.executable).parent      # hgtrain and python of this environment
    env = {k: v for k, v in os.environ.items() if not k.startswith("HGTRAIN_")}
    env.update(HOME=str(node_home), PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(REPO))
    yield work, env
    jobs = work / ".hgtrain" / "jobs"
    started_jobs.extend(sorted(os.listdir(jobs)) if jobs.is_dir() else [])


def test_every_shell_snippet_is_found_and_each_skip_gives_its_reason():
    assert any(s.where.startswith("docs/ci.md") for s in SNIPPETS)
    assert all(s.skip is None or s.skip.strip() for s in SNIPPETS)
    runnable = [s.where for s in SNIPPETS if s.skip is None]
    assert runnable, "no snippet runs: the test would prove nothing"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.where for s in SNIPPETS])
def test_shell_snippet_runs(snippet: Snippet, request):
    if snippet.skip is not None:
        pytest.skip(f"marked in the docs: {snippet.skip}")
    if shutil.which("jq") is None and "jq " in snippet.code:
        pytest.fail("jq is not installed (scripts/setup installs it)")
    work, env = request.getfixturevalue("sandbox")
    done = subprocess.run(["bash", "-c", snippet.code], cwd=work, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{snippet.where} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    if "train.py" in snippet.code and "hgtrain logs" in snippet.code:
        # the job really ran and its lines came back through `hgtrain logs -f`
        assert "trained on rank 0" in done.stdout and "trained on rank 1" in done.stdout, done.stdout
