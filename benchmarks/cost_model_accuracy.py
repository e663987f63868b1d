"""How well the planner's cost model predicts real samples/s, and whether ``auto`` picks the best (issue 3).

For each emulated cluster (devices on this machine's CPU, speeds declared like a cluster file's
``emulate``), the profiles are MEASURED, not made up: ``probe_cluster`` + ``bench_cluster`` (quick)
on a local emulated node, timing the model the example actually trains (``hgcli.examples.models:
example`` at this run's hidden size), so the planner's time(batch) fits that model. Then for each
strategy (allreduce, hybrid, ps) ``hgcli.plan.placement.make_plan`` builds the plan, ``localrun`` runs every
rank of it as real processes on ``python -m hgcli.examples.train_mlp`` for a fixed number of steps, and
the steady-state samples/s is measured: samples of every worker's steps between the moment the
last worker took its first step and the moment the first worker took its last (so start-up, the
first step and a group that finishes early do not count).

Speeds are the nominal ones x --time-scale, as in benchmarks/hybrid_vs_allreduce.py: this machine has
2 cores for 4-5 ranks, and emulation sleeps a slow device's step to cpu / speed, so scaling every
speed down keeps the CPU from being the bottleneck that a real cluster would not have.

Rounds (--rounds, default 3): this machine's speed drifts by 20-40% over seconds (the same step's
CPU time, in one process, 4.4 ms and 7.6 ms a few seconds apart; the quick bench of one speed-0.1
device run seven times in a row: batch 64 at 28-49 ms, batch 128 at 47-65 ms), so one bench against
one run of each strategy compares two draws of that drift, not the model with the machine. Each round benches the cluster afresh and runs
every strategy once (the order rotated each round, so no strategy always runs first after the
bench); the error is the median prediction over rounds against the median measurement, and every
round's own errors are printed and kept in the JSON too.

"auto chose the measured-best" is decided within noise: auto's strategy counts as best when its
median measured samples/s is within max(5%, 2 combined standard errors) of the fastest one's. 5% is
the planner's own AUTO_MARGIN (it does not claim to tell strategies closer than that apart); the
standard error of a strategy's median is its rounds' spread (sd / sqrt(rounds)), or with one round
its run's throughput over 6 equal slices of its steady window. auto's strategy is the one it chose
in most rounds (the first round's on a tie).
On a homogeneous cluster auto is one all-reduce group by rule 1 (docs/planning.md), whatever the
predictions say; so the benchmark also reports what the predictions alone favour
(``hgcli.plan.strategy.predicted_best`` of the median predictions: auto's own margins without rule 1), judged
the same way, to tell the cost model's ranking from the rule's choice.

A sharded group (issue 49): ``--strategies allreduce,fsdp`` adds the run ``fsdp``, the all-reduce plan
with every group on FSDP2 (``--engine fsdp``), whose prediction prices its gathers and reduce-scatter
instead of DDP's all-reduce (docs/planning.md, "Sharded groups"), against DDP's on the same devices.

    PYTHONPATH=$PWD python3 benchmarks/cost_model_accuracy.py      (about 13 minutes; --rounds 1: 4-5)
    PYTHONPATH=$PWD python3 benchmarks/cost_model_accuracy.py --clusters 2fast+2slow \
        --strategies allreduce,fsdp --rounds 1 --steps 60          (the fsdp case, a few minutes)
Readable table, then as the LAST line one JSON object with every figure and ratio.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CLUSTERS = {
    "2fast+2slow": [1.0, 1.0, 0.25, 0.25],
    "3-speed": [1.0, 0.5, 0.5, 0.2],
    "homogeneous": [1.0, 1.0, 1.0, 1.0],
}
STRATEGIES = ("allreduce", "hybrid", "ps")
# The all-reduce plan with every group sharded (--engine fsdp): a run of its own beside the strategies.
FSDP = "fsdp"
GOAL_ERROR = 0.20
AUTO_TOLERANCE = 0.05
SLICES = 6


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clusters", default=",".join(CLUSTERS), help="which of: " + ", ".join(CLUSTERS))
    p.add_argument("--hidden", type=int, default=4096, help="hidden width of the example MLP")
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=120, help="local steps per worker in each run")
    p.add_argument("--time-scale", type=float, default=0.1,
                   help="emulated speed = nominal speed x this (keeps the 2 shared cores from saturating)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    p.add_argument("--rounds", type=int, default=3, help="bench + one run of every strategy, per cluster")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"runs, of: {', '.join(STRATEGIES)}, {FSDP} (allreduce with every group on FSDP2)")
    return p.parse_args()


def measure_profiles(name: str, speeds: list[float], args: argparse.Namespace, workdir: Path) -> tuple[Any, Any]:
    """A one-node emulated cluster, probed and benched for real (quick) on the example model."""
    from hgcli.bench.cluster import bench_cluster
    from hgcli.schema.stages import Cluster, EmulateSpec, NodeSpec
    from hgcli.probe.inventory import probe_cluster

    factory = workdir / f"example_h{args.hidden}.py"
    factory.write_text("from hgcli.examples.models import example\n\n\n"
                       f"def factory():\n    return example(hidden={args.hidden})\n")
    emulate = EmulateSpec(devices=tuple(f"emu-x{s:g}" for s in speeds),
                          speed=tuple(s * args.time_scale for s in speeds),
                          memory_mib=(16384,) * len(speeds))
    cluster = Cluster(nodes=(NodeSpec(name="local", host="localhost", python=sys.executable, emulate=emulate),))
    inventory = probe_cluster(cluster)
    if not all(n.ok for n in inventory.nodes):
        raise SystemExit(f"{name}: probe failed: {[n.error for n in inventory.nodes]}")
    batches = sorted({4, 16, 64, args.global_batch // len(speeds), 2 * args.global_batch // len(speeds)})
    profiles = bench_cluster(cluster, inventory, quick=True,
                             model_spec=f"{factory}:factory@{','.join(map(str, batches))}")
    bad = [d.error for d in profiles.devices if d.error]
    if bad:
        raise SystemExit(f"{name}: bench failed: {bad}")
    return inventory, profiles


def train_argv(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "hgcli.examples.train_mlp", "--epochs", "1000", "--max-steps", str(args.steps),
            "--hidden", str(args.hidden), "--eval-every", "1000000000", "--eval-samples", "256"]


def steady_rate(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Samples/s of all workers while every worker was stepping, and its standard error."""
    steps = [m for m in metrics if "step" in m and "samples" in m and "event" not in m]
    by_rank: dict[int, list[float]] = {}
    for m in steps:
        by_rank.setdefault(m["rank"], []).append(m["time"])
    t0 = max(min(ts) for ts in by_rank.values())
    t1 = min(max(ts) for ts in by_rank.values())
    if t1 <= t0:
        raise SystemExit("no window in which every worker was stepping")
    inside = [m for m in steps if t0 < m["time"] <= t1]
    rate = sum(m["samples"] for m in inside) / (t1 - t0)
    width = (t1 - t0) / SLICES
    slices = [sum(m["samples"] for m in inside if t0 + k * width < m["time"] <= t0 + (k + 1) * width) / width
              for k in range(SLICES)]
    return {"samples_per_s": rate, "stderr": statistics.stdev(slices) / math.sqrt(SLICES), "window_s": t1 - t0}


def run_strategy(plan: Any, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    from hgcli.local.run import run_plan

    result = run_plan(plan, train_argv(args), workdir=workdir, timeout_s=args.timeout)
    with open(workdir / "metrics.jsonl", "w", encoding="utf-8") as fh:   # for a look at per-step terms
        fh.writelines(json.dumps(m) + "\n" for m in result.metrics)
    finished = {m["rank"] for m in result.metrics if m.get("event") == "finish"}
    # The example's first worker evaluates the model alone after ctx.finish(); under FSDP2 that forward
    # gathers from ranks that have exited and fails. Every worker's steps are done by then and the
    # steady window is all this measures, so such a run counts (and says so).
    if not result.ok and not finished >= {r.rank for r in plan.workers}:
        bad = result.first_failure or result.ranks[0]
        raise SystemExit(f"run failed: rank {bad.rank} exit {bad.exit_code}\n{bad.output()[-3000:]}")
    out = steady_rate(result.metrics)
    out["final_eval_failed"] = float(not result.ok)
    syncs = [m for m in result.metrics if m.get("event") == "sync"]
    fins = [m for m in result.metrics if m.get("event") == "finish"]
    compute, slept = sum(m["compute_s"] for m in fins), sum(m["emulated_sleep_s"] for m in fins)
    out["compute_share"] = compute / (compute + slept) if compute + slept else 0.0
    # where a worker's steps go besides compute: its group's all-reduce / PS exchange / broadcast
    out["sync_ms_per_step"] = statistics.median(1e3 * m["sync_s"] / max(1, m["steps"]) for m in fins)
    out["pushes"] = float(len(syncs))
    out["push_s_mean"] = statistics.mean(m["push_s"] for m in syncs) if syncs else 0.0
    # each worker's CPU per step (start-up included): what the emulator stretches x 1/speed, and
    # what the group bench's compute_ratio prices for members of synchronous groups
    out["cpu_ms_per_step"] = [round(1e3 * m["compute_s"] / max(1, m["steps"]), 3)
                              for m in sorted(fins, key=lambda m: m["rank"])]
    out["elapsed_s"] = result.elapsed_s
    out["load_1min"] = os.getloadavg()[0]   # other jobs on this machine: the misses' usual cause
    return out


def evaluate_round(name: str, speeds: list[float], args: argparse.Namespace, workdir: Path,
                   round_: int) -> dict[str, Any]:
    """A fresh bench of the cluster, then one run of every strategy (order rotated by round)."""
    from hgcli.schema.stages import Engine, JobSpec, Strategy
    from hgcli.plan.placement import make_plan

    inventory, profiles = measure_profiles(name, speeds, args, workdir)
    bench_load = os.getloadavg()[0]
    auto = make_plan(inventory, profiles, JobSpec(strategy=Strategy.AUTO, global_batch=args.global_batch))
    runs: dict[str, Any] = {}
    runs_of = args.strategies
    order = runs_of[round_ % len(runs_of):] + runs_of[:round_ % len(runs_of)]
    for strategy in order:
        job = (JobSpec(strategy=Strategy.ALLREDUCE, global_batch=args.global_batch, engine=Engine.FSDP)
               if strategy == FSDP else JobSpec(strategy=Strategy(strategy), global_batch=args.global_batch))
        plan = make_plan(inventory, profiles, job)
        measured = run_strategy(plan, args, workdir / f"{name}-r{round_}-{strategy}")
        predicted = plan.predicted_samples_per_s[plan.strategy]
        runs[strategy] = {
            "predicted": predicted, **measured, "error": predicted / measured["samples_per_s"] - 1,
            "engines": [g.engine.value for g in plan.groups],
            "groups": [list(g.ranks) for g in plan.groups], "accumulate": [g.accumulate for g in plan.groups],
            "batches": [r.batch_size for r in plan.workers], "ps": len(plan.ps_shards),
            "staleness": plan.staleness_bound,
        }
        print(f"... {name} round {round_}/{strategy}: {runs[strategy]}", file=sys.stderr, flush=True)
    steps = {d.device: [(s.batch_size, s.seconds.median) for s in d.steps] for d in profiles.devices}
    sync = profiles.devices[0].group_sync     # the node's group bench (all devices: one node)
    group = None if sync is None else {
        "ms": 1e3 * sync.seconds.median, "batch": sync.batch, "speed": sync.speed,
        "compute_ratio": sync.compute_ratio.median if sync.compute_ratio else None}
    # auto's rule 1 (docs/planning.md): a homogeneous cluster is one all-reduce group whatever the
    # predictions say, so a miss there is the rule's, not the cost model's; reported as such.
    return {"runs": {s: runs[s] for s in args.strategies}, "auto": auto.strategy.value, "auto_reason": auto.reason,
            "auto_by_homogeneous_rule": auto.reason.startswith("homogeneous"), "bench_load_1min": bench_load,
            "profile_steps": steps, "group_sync": group}


def evaluate(name: str, speeds: list[float], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rounds = [evaluate_round(name, speeds, args, workdir, k) for k in range(args.rounds)]
    summary: dict[str, Any] = {}
    for strategy in args.strategies:
        runs = [r["runs"][strategy] for r in rounds]
        measured = [run["samples_per_s"] for run in runs]
        predicted, rate = statistics.median(run["predicted"] for run in runs), statistics.median(measured)
        stderr = statistics.stdev(measured) / math.sqrt(len(runs)) if len(runs) > 1 else runs[0]["stderr"]
        # the layout shown is the last round's: each round's fresh bench may move batches/accumulation
        summary[strategy] = {"predicted": predicted, "samples_per_s": rate, "stderr": stderr,
                             "error": predicted / rate - 1, "round_errors": [run["error"] for run in runs],
                             "layout": _layout(runs[-1]), "ps": runs[-1]["ps"],
                             "compute_share": statistics.median(run["compute_share"] for run in runs),
                             "sync_ms_per_step": statistics.median(run["sync_ms_per_step"] for run in runs),
                             "load_1min": statistics.median(run["load_1min"] for run in runs)}
    from hgcli.plan.strategy import predicted_best
    from hgcli.schema.stages import Strategy

    choices = [r["auto"] for r in rounds]
    chosen = max(choices, key=lambda c: (choices.count(c), -choices.index(c)))
    best = max(args.strategies, key=lambda s: summary[s]["samples_per_s"])
    gap, tolerance = _shortfall(summary, chosen, best)
    # What the predictions alone favour (the median predictions through auto's own margins): the
    # cost model's pick, which rule 1 overrides on a homogeneous cluster.
    strategies = {Strategy(s): summary[s]["predicted"] for s in STRATEGIES if s in summary}
    pick = (predicted_best(strategies).value if len(strategies) == len(STRATEGIES)
            else max(args.strategies, key=lambda s: summary[s]["predicted"]))
    pick_gap, pick_tolerance = _shortfall(summary, pick, best)
    return {"speeds": speeds, "emulated_speeds": [s * args.time_scale for s in speeds], "strategies": summary,
            "rounds": rounds, "auto": chosen, "auto_choices": choices,
            "auto_by_homogeneous_rule": all(r["auto_by_homogeneous_rule"] for r in rounds),
            "measured_best": best, "auto_gap": gap, "auto_tolerance": tolerance, "auto_ok": gap <= tolerance,
            "model_pick": pick, "model_pick_gap": pick_gap, "model_pick_ok": pick_gap <= pick_tolerance,
            "max_abs_error": max(abs(v["error"]) for v in summary.values()),
            "max_abs_round_error": max(abs(e) for v in summary.values() for e in v["round_errors"])}


def _shortfall(summary: dict[str, Any], chosen: str, best: str) -> tuple[float, float]:
    """How far ``chosen`` measured below ``best``, and the tolerance of that judgement (a gap of 1 where
    ``chosen`` was not among the runs)."""
    if chosen not in summary:
        return 1.0, AUTO_TOLERANCE
    gap = 1 - summary[chosen]["samples_per_s"] / summary[best]["samples_per_s"]
    noise = 2 * math.hypot(summary[chosen]["stderr"], summary[best]["stderr"]) / summary[best]["samples_per_s"]
    return gap, max(AUTO_TOLERANCE, noise)


def _layout(run: dict[str, Any]) -> str:
    return "+".join(f"{len(g)}x{a}" for g, a in zip(run["groups"], run["accumulate"]))


def main() -> int:
    args = parse_args()
    args.strategies = tuple(args.strategies.split(","))
    workdir = Path(tempfile.mkdtemp(prefix="hgtrain-costmodel-"))
    os.environ["HGTRAIN_STATE_DIR"] = str(workdir / "state")    # profiles of this run only
    started = time.monotonic()
    results = {name: evaluate(name, CLUSTERS[name], args, workdir) for name in args.clusters.split(",")}

    print(f"example MLP hidden {args.hidden}, global batch {args.global_batch}, {args.steps} steps per "
          f"worker, emulated speed = nominal x {args.time_scale}; profiles: bench --quick of the same model; "
          f"{args.rounds} round(s) of bench + every strategy per cluster, medians over rounds")
    print(f"{'cluster':14} {'strategy':10} {'predicted':>10} {'measured':>10} {'+-se':>6} {'error':>7} "
          f"{'each round':>22} {'groups x acc':>16} {'PS':>3} {'compute':>8} {'sync ms':>7} {'load':>5}")
    for name, r in results.items():
        for s in args.strategies:
            v = r["strategies"][s]
            each = " ".join(f"{e:+.0%}" for e in v["round_errors"])
            print(f"{name:14} {s:10} {v['predicted']:10.0f} {v['samples_per_s']:10.0f} "
                  f"{v['stderr']:6.0f} {v['error']:+7.1%} {each:>22} {v['layout']:>16} {v['ps']:3d} "
                  f"{v['compute_share']:8.2f} {v['sync_ms_per_step']:7.1f} {v['load_1min']:5.1f}")
        ratios = [g["group_sync"]["compute_ratio"] for g in r["rounds"] if g["group_sync"]]
        if ratios:
            print(f"{'':14} group bench: CPU per step synchronous / free "
                  f"{', '.join('-' if x is None else f'{x:.3f}' for x in ratios)} (per round)")
        verdict = "yes" if r["auto_ok"] else "NO"
        if r["auto_by_homogeneous_rule"]:
            verdict += (" (auto followed the homogeneous rule: one all-reduce group, no PS, never worse than DDP; "
                        f"the predictions alone favour {r['model_pick']}: "
                        f"{'right' if r['model_pick_ok'] else 'WRONG'}, {r['model_pick_gap']:.1%} below best)")
        print(f"{'':14} auto chose {r['auto']} (rounds: {', '.join(r['auto_choices'])}), measured best "
              f"{r['measured_best']} (auto {r['auto_gap']:.1%} below best, tolerance {r['auto_tolerance']:.1%}): "
              f"{verdict}")
    worst = max(r["max_abs_error"] for r in results.values())
    all_auto = all(r["auto_ok"] for r in results.values())
    # Where auto followed rule 1 (a homogeneous cluster is plain DDP: the issue's own requirement),
    # the cost model's part is what its predictions favour; elsewhere auto's choice is the model's.
    free = all(r["auto_ok"] for r in results.values() if not r["auto_by_homogeneous_rule"])
    goals = {"error_within_20%": worst <= GOAL_ERROR, "auto_chose_measured_best": all_auto,
             "auto_chose_measured_best_outside_rule_1": free,
             "predictions_favour_measured_best": all(r["model_pick_ok"] for r in results.values())}
    print(f"largest |error| {worst:.1%} (goal {GOAL_ERROR:.0%}): {'met' if goals['error_within_20%'] else 'MISSED'}; "
          f"auto chose the measured best everywhere: {'met' if all_auto else 'MISSED'} (outside rule 1: "
          f"{'met' if free else 'MISSED'}; the predictions alone "
          f"favour it everywhere: {'yes' if goals['predictions_favour_measured_best'] else 'no'}); largest |error| of a "
          f"single round {max(r['max_abs_round_error'] for r in results.values()):.1%}; "
          f"{time.monotonic() - started:.0f} s; profiles and each run's metrics.jsonl in {workdir}")
    print(json.dumps({"benchmark": "cost_model_accuracy", "hidden": args.hidden, "global_batch": args.global_batch,
                      "steps": args.steps, "time_scale": args.time_scale, "rounds": args.rounds, "clusters": results,
                      "largest_abs_error": worst, "goals": goals, "workdir": str(workdir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
