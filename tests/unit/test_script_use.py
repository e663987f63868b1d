"""auto gives parameter servers only to a script that calls hg.init() (issue 52): known from its last
job's stored rates, else from a parse of its entry module (plan/script_use.py)."""
from __future__ import annotations

from pathlib import Path

from hgcli.bench.rates import store_rates
from hgcli.plan.placement import make_plan
from hgcli.plan.script_use import ScriptUse, entry_path, imported_modules, script_use, static_use
from hgcli.schema.stages import JobSpec, MeasuredRate, ScriptRates, Strategy
from tests.unit.test_plan import slow_network_cluster as slow_network   # auto picks hybrid there

REPO = Path(__file__).resolve().parents[2]


def test_auto_plans_allreduce_for_a_script_without_hg_init_and_says_why_in_the_reason():
    inventory, profiles = slow_network()
    job = JobSpec(global_batch=2048)
    ported = make_plan(inventory, profiles, job, script=ScriptUse(True, "train.py imports hgcli.runtime"))
    assert ported.strategy is Strategy.HYBRID and ported.ps_shards
    unported = make_plan(inventory, profiles, job, script=ScriptUse(False, "train.py does not import hgcli.runtime"))
    assert unported.strategy is Strategy.ALLREDUCE and not unported.ps_shards
    assert "not hybrid: train.py does not import hgcli.runtime" in unported.reason
    assert "auto would choose hybrid" in unported.reason
    # A requested strategy is the user's: kept (the launch says what the workers must do).
    forced = make_plan(inventory, profiles, JobSpec(global_batch=2048, strategy=Strategy.HYBRID),
                       script=ScriptUse(False, "x"))
    assert forced.strategy is Strategy.HYBRID


def test_imports_of_the_runtime_are_found_in_every_spelling(tmp_path):
    def static_use_of(source: str) -> ScriptUse:
        path = tmp_path / "train.py"
        path.write_text(source)
        return static_use(path)

    for source in ("import hgcli.runtime as hg", "from hgcli import runtime as hg",
                   "from hgcli.runtime import init", "import os, hgcli.runtime.metrics",
                   "def main():\n    import hgcli.runtime as hg\n"):
        assert static_use_of(source).runtime, source
    for source in ("import torch.distributed as dist", "from hgcli.examples.data import make_model",
                   "from . import runtime", "x = 'import hgcli.runtime'"):
        assert not static_use_of(source).runtime, source
    assert "integration" in static_use_of("from hgcli.integrations.lightning import HgtrainStrategy").why
    assert "from hgcli import runtime" not in imported_modules("import hgcli")


def test_the_entry_module_is_found_by_path_or_module_name(tmp_path):
    (tmp_path / "train.py").write_text("import hgcli.runtime as hg\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__main__.py").write_text("import torch\n")
    assert entry_path("script train.py", tmp_path, []) == tmp_path / "train.py"
    assert entry_path("module pkg", tmp_path, []) == tmp_path / "pkg" / "__main__.py"
    assert entry_path("module hgcli.examples.train", tmp_path, [str(REPO)]) == REPO / "hgcli/examples/train.py"
    assert entry_path("script missing.py", tmp_path, []) is None
    assert entry_path("command ./a.out --x", tmp_path, []) is None
    assert script_use("f", "module hgcli.examples.train", tmp_path, [str(REPO)]).runtime
    plain = script_use("f", "module hgcli.examples.torchrun_style", tmp_path, [str(REPO)])
    assert not plain.runtime and "torchrun_style.py does not import hgcli.runtime" in plain.why
    assert not script_use("f", "script missing.py", tmp_path, []).runtime


def test_a_script_whose_last_job_called_hg_init_may_have_parameter_servers(tmp_path, private_state_dir):
    # The entry module alone does not show it (the runtime is reached through a helper module).
    (tmp_path / "train.py").write_text("from mylib import setup\n")
    assert not script_use("cafe", "script train.py", tmp_path, []).runtime
    store_rates(ScriptRates(cluster="cafe", script="script train.py", job_id="j1", measured_at=1.0,
                            bench_measured_at=1.0,
                            rates=(MeasuredRate(node="a", device="cpu", batch_size=8.0, samples_per_s=10.0),)))
    assert script_use("cafe", "script train.py", tmp_path, []) == ScriptUse(True, "its last job called hg.init()")
