"""benchmarks/pipeline_e2e.py's per-script options and the DDP twins' environment (no training)."""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

from hgcli.examples import recipe

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def e2e(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))     # as when a script in benchmarks/ runs
    return importlib.import_module("pipeline_e2e")


def test_resnet_flags_are_the_examples_own(e2e: ModuleType) -> None:
    """What the benchmark passes hgcli.examples.train (and its DDP twin, which parses the same way)
    is read by the example's parser as the benchmark's defaults for it."""
    args = e2e.parse_args(["--script", "hgcli.examples.train", "--quick"])
    assert (args.global_batch, args.epochs, args.target, args.ideal_steps) == (128, 3, 0.90, 10)
    script = e2e.SCRIPTS[args.script]
    trained = recipe.parse_args("twin", script.flags(args))
    assert (trained.epochs, trained.lr, trained.train_size, trained.target) == (3, 5e-3, 4096, 0.90)
    ideal = recipe.parse_args("twin", [*script.flags(args), *script.steps_flag(7), *script.no_eval])
    assert (ideal.max_steps, ideal.test_size, ideal.eval_samples) == (7, 64, 64)
    assert e2e.ideal_batches(args) == [16, 32, 64]
    full = e2e.parse_args(["--script", "hgcli.examples.train", "--epochs", "2"])
    assert (full.epochs, full.target, full.ideal_steps) == (2, 0.95, 20)


def test_mlp_defaults_and_foreign_options(e2e: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = e2e.parse_args(["--quick"])
    assert (args.script, args.global_batch, args.hidden, args.epochs, args.target) == (
        "hgcli.examples.train_mlp", 256, 4096, 2, 0.90)
    assert "--hidden" in e2e.SCRIPTS[args.script].flags(args)
    with pytest.raises(SystemExit) as exc:
        e2e.parse_args(["--script", "hgcli.examples.train", "--hidden", "64"])
    assert exc.value.code == 2
    assert "hgcli.examples.train does not take --hidden" in capsys.readouterr().err


def test_twin_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    emulation = importlib.import_module("ddp_emulation")
    env = {"RANK": "2", "E2E_SPEEDS": "0.1,0.1,0.025,0.025", "E2E_BATCHES": "53,53,11,11",
           "E2E_METRICS": "/m", "HGTRAIN_EMULATE_STRAGGLER": "3", "HGTRAIN_EMULATE_SEED": "7"}
    s = emulation.settings(env, world=4)
    assert (s.speed, s.batches, s.metrics, s.straggler_factor, s.straggler_seed) == (
        0.025, [53, 53, 11, 11], "/m", 3.0, 7)
    with pytest.raises(SystemExit, match="need 3 entries each"):
        emulation.settings(env, world=3)
    with pytest.raises(SystemExit, match="E2E_METRICS is not set"):
        emulation.settings({k: v for k, v in env.items() if k != "E2E_METRICS"}, world=4)
    with pytest.raises(SystemExit, match="at least 1"):
        emulation.settings({**env, "E2E_BATCHES": "53,53,0,11"}, world=4)
    assert s.slowdown == []
    assert emulation.settings({**env, "E2E_SLOWDOWN": "2:20.5:4"}, world=4).slowdown == [(20.5, 4.0)]
    assert emulation.settings({**env, "E2E_SLOWDOWN": "0:20.5:4"}, world=4).slowdown == []   # another rank's
    with pytest.raises(SystemExit, match="E2E_SLOWDOWN"):
        emulation.settings({**env, "E2E_SLOWDOWN": "2:20"}, world=4)


def test_the_slowdown_scenario_declares_it_in_the_cluster_file(e2e: ModuleType, tmp_path) -> None:
    from hgcli.config.cluster import load_cluster

    path = tmp_path / "c.toml"
    e2e.cluster_file(path, [1.0, 1.0, 0.25, 0.25], 0.1, e2e.Dynamics(slowed=0, after_s=21.25, factor=4.0))
    emulate = load_cluster(path).nodes[0].emulate
    assert emulate.speed == (0.1, 0.1, 0.025, 0.025) and [(s.device, s.after_s, s.factor)
                                                          for s in emulate.slowdown] == [(0, 21.2, 4.0)]


def test_with_several_pairs_the_ratio_to_ddp_is_the_pairs_median(e2e: ModuleType) -> None:
    def run(sps: float) -> dict:
        return {"samples_per_s": sps, "x_ideal": 0.5, "time_to_target_s": None, "final_accuracy": 0.9,
                "error": 0.0, "strategy": "allreduce"}
    runs = {"pipeline": run(90.0), "ddp-uniform": run(100.0), "ddp-prop": run(100.0)}
    result = {"homogeneous": {"runs": runs, "stragglers": False, "pairs": [(90.0, 100.0), (99.0, 100.0), (96.0, 100.0)]}}
    ratios, goals = e2e.ratios_and_goals(result)
    assert ratios["homogeneous_vs_prop_pairs"] == [0.9, 0.99, 0.96]
    assert ratios["homogeneous_vs_prop"] == 0.96                 # the median, not the first pair's 0.9
    assert goals["homogeneous_vs_ddp>=0.97"] is False


def test_the_examples_loss_is_read_every_tenth_step_and_samples_every_step() -> None:
    """Reading the loss is a host sync on a GPU: the example logs it every LOSS_EVERY steps only."""
    import torch

    logged: list[dict] = []
    report = recipe.Report(recipe.parse_args("twin", []), torch.device("cpu"), None, main=True,
                           log=lambda **fields: logged.append(fields))
    for step in range(12):
        report.step(step, torch.tensor(1.5), 4)
    assert [f["step"] for f in logged] == list(range(12)) and all(f["samples"] == 4 for f in logged)
    assert [f["step"] for f in logged if "loss" in f] == [0, 10]
