"""benchmarks/hybrid_links.py's planned strategies: the planner's plans from measured inputs (no training)."""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from types import ModuleType

import pytest

from hgcli.schema.stages import Strategy
from tests.unit.test_plan_shards import links_scenario

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def links(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))     # as when a script in benchmarks/ runs
    return importlib.import_module("hybrid_links")


def test_planned_strategies_are_the_planners_and_auto_runs_once(links: ModuleType, tmp_path: Path) -> None:
    """The inputs survive the profiles.json round trip (--profiles), each planned strategy is
    make_plan's for that strategy, and auto's plan is recognised as the one of the strategy it chose
    (the benchmark runs it once), while a different plan is not."""
    inventory, profiles = links_scenario(cores=2)
    path = tmp_path / "profiles.json"
    links.save_inputs({"inventory": inventory, "profiles": profiles, "link_source": "measured"}, path)
    inputs = links.load_inputs(path)
    assert (inputs["inventory"], inputs["profiles"]) == (inventory, profiles)
    assert inputs["link_source"] == "measured, reused"
    args = argparse.Namespace(global_batch=40)
    plans = {s: links.planned(s, inputs, args) for s in links.PLANNED}
    assert plans["planned-hybrid"].strategy is Strategy.HYBRID and plans["planned-hybrid"].ps_shards
    assert plans["planned-allreduce"].strategy is Strategy.ALLREDUCE
    chosen = plans["planned-auto"].strategy.value
    assert links._same_plan(plans["planned-auto"], plans[f"planned-{chosen}"])
    assert not links._same_plan(plans["planned-hybrid"], plans["planned-allreduce"])
    # the layout column: batches per rank x accumulation, PS ranks and bound
    acc = [g.accumulate for g in plans["planned-hybrid"].groups]
    assert links.layout(plans["planned-hybrid"]).startswith("[17,17]x%d + [3,3]x%d, 1 PS, S=" % tuple(acc))


def test_auto_is_judged_against_the_fastest_run_within_five_percent(links: ModuleType) -> None:
    inventory, profiles = links_scenario(cores=2)
    inputs = {"inventory": inventory, "profiles": profiles, "link_source": "measured"}
    plans = {"planned-auto": links.planned("planned-auto", inputs, argparse.Namespace(global_batch=40))}
    runs = {"allreduce-prop": {"samples_per_s": 10.0}, "planned-auto": {"samples_per_s": 9.6}}
    assert links.judge_auto(runs, plans)["ok"] and links.judge_auto(runs, plans)["best"] == "allreduce-prop"
    runs["planned-auto"]["samples_per_s"] = 9.4
    assert not links.judge_auto(runs, plans)["ok"]
    assert links.judge_auto({"allreduce-prop": {"samples_per_s": 1.0}}, {}) is None


def test_the_tc_rate_is_the_fallback_links_bandwidth(links: ModuleType) -> None:
    assert links.configured_link("1gbit").bandwidth_gbs.median == pytest.approx(0.125)
    assert links.configured_link("500mbit").bandwidth_gbs.median == pytest.approx(0.0625)


def test_eval_pauses_are_rank_0s_evaluated_steps_beyond_their_parity(links: ModuleType) -> None:
    """A group accumulating 2 steps alternates 1 s and 3 s steps; evaluations at steps 8 and 16 add
    5 s and 2 s to the steps into them (both synchronising steps): 7 s in all. Other ranks and
    event lines do not count."""
    t, metrics = 0.0, []
    for step in range(20):
        t += (3.0 if step % 2 == 0 else 1.0) + {8: 5.0, 16: 2.0}.get(step, 0.0)
        metrics.append({"rank": 0, "step": step, "time": t, "samples": 19})
        metrics.append({"rank": 1, "step": step, "time": t + 9.0 * (step == 8), "samples": 19})
    metrics.append({"rank": 0, "event": "eval", "step": 8, "time": t})
    assert links.eval_pauses(metrics, 8) == pytest.approx(7.0)
