"""Planned per-device batches against uniform ones, through each framework integration, on an
emulated [1, 1, 0.25, 0.25] mix (issue 33).

    PYTHONPATH=. .venv/bin/python benchmarks/frameworks.py [--frameworks lightning,transformers,accelerate]
                                                          [--pairs 1] [--time-scale 0.25]

One node (this machine) declaring four emulated devices in one all-reduce group; every run is
``hgtrain launch --plan`` of benchmarks/frameworks_train.py through its integration
(``HgtrainStrategy``, ``HgtrainTrainer``, ``hgcli.integrations.accelerate.Hgtrain``), so both arms
are emulated alike by the integration:

  uniform   the plan's batches equal: every rank trains the script's per-device batch (the
            framework's own sampler), and every step waits for the slow devices;
  planned   the plan's batches in proportion to the speeds (40/40/10/10): the integration splits
            the script's global batch 26/26/6/6 for a per-device batch of 16.

Both train the same global batch for the same optimizer steps with the same optimizer, so their
final losses (rank 0's loss over the whole dataset after training) should agree within the noise of
the data order. samples/s is the steady rate: global batch x steps between every rank's 3rd and last
step, over the time between them (the ranks' own metric time stamps). Emulated speed = nominal x
--time-scale (0.25: the four ranks ask 0.625 of this machine's cores rather than 2.5, and the
emulated compute outweighs the frameworks' own per-step work, which is not stretched). Prints a table, then
one JSON line with the figures and a ``goals`` object: planned >= 1.3 x uniform samples/s, final
loss within 10% of uniform's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.launch.hg import cluster_toml  # noqa: E402
from tests.launch.plans import local_cluster, make_plan, plan_file  # noqa: E402

PY = sys.executable
SCRIPT = REPO / "benchmarks" / "frameworks_train.py"
SPEEDS = (1.0, 1.0, 0.25, 0.25)
BATCH = 16                      # the script's per-device batch
GOAL_SPEEDUP, GOAL_LOSS = 1.3, 0.10


def plan_for(batches: list[int], speeds: list[float]):
    plan = make_plan(local_cluster(("local",)), [["local"] * len(batches)], batch=1)
    ranks = tuple(dataclasses.replace(r, batch_size=b, speed=s) for r, b, s in zip(plan.ranks, batches, speeds))
    return dataclasses.replace(plan, ranks=ranks, global_batch=sum(batches))


def steady_rate(metrics: list[dict[str, Any]], global_batch: int, skip: int = 3) -> tuple[float, int]:
    """Samples/s between every rank's ``skip``-th and last step; and the steps."""
    by_step: dict[int, list[float]] = {}
    for m in metrics:
        if "step" in m and "event" not in m:
            by_step.setdefault(int(m["step"]), []).append(float(m["time"]))
    ranks = max(len(v) for v in by_step.values())
    done = sorted(s for s, times in by_step.items() if len(times) == ranks)
    first, last = done[min(skip, len(done) - 2)], done[-1]
    elapsed = max(by_step[last]) - max(by_step[first])
    return (last - first) * global_batch / elapsed, last


def run(framework: str, arm: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    speeds = [s * args.time_scale for s in SPEEDS]
    batches = [BATCH] * 4 if arm == "uniform" else [int(40 * s) for s in SPEEDS]
    here = work / f"{framework}-{arm}-{time.monotonic_ns()}"
    here.mkdir(parents=True)
    plan = plan_for(batches, speeds)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HGTRAIN_STATE_DIR": str(here / "state")}
    argv = [PY, "-m", "hgcli", "launch", "-c", str(cluster_toml(here / "cluster.toml", local_cluster(("local",)))),
            "--plan", str(plan_file(here, plan)), "--no-adapt", "--json", "--",
            PY, str(SCRIPT), framework, "--batch", str(BATCH), "--epochs", str(args.epochs)]
    began = time.monotonic()
    done = subprocess.run(argv, env=env, cwd=here, capture_output=True, text=True, timeout=1800)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode:
        lines = "\n".join(e.get("line", "") for e in events if e["event"] == "log")
        raise SystemExit(f"{framework} {arm}: exit {done.returncode}\n{done.stderr[-3000:]}\n{lines[-3000:]}")
    metrics = [e["data"] for e in events if e["event"] == "metric"]
    rate, steps = steady_rate(metrics, BATCH * 4)
    finals = [e["line"] for e in events if e["event"] == "log" and e["line"].startswith("final loss")]
    shares = sorted({(m["rank"], m["samples"]) for m in metrics if "step" in m and "event" not in m})
    finish = [m for m in metrics if m.get("event") == "finish"]
    compute = sum(m.get("compute_s") or 0.0 for m in finish)
    stretched = sum(m.get("emulated_step_s") or 0.0 for m in finish)
    return {"framework": framework, "arm": arm, "plan_batches": batches, "shares": [s for _, s in shares],
            "samples_per_s": rate, "steps": steps, "final_loss": float(finals[0].split()[-1]),
            "job_s": time.monotonic() - began, "emulated_compute_share": compute / stretched if stretched else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frameworks", default="lightning,transformers,accelerate")
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--time-scale", type=float, default=0.25)
    args = parser.parse_args()
    frameworks = args.frameworks.split(",")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hg-frameworks-") as tmp:
        for _ in range(args.pairs):
            for framework in frameworks:
                for arm in ("uniform", "planned"):       # interleaved: the machine's load drifts
                    results.append(run(framework, arm, Path(tmp), args))
                    r = results[-1]
                    print(f"  {framework:12s} {arm:8s} {r['samples_per_s']:8.1f} samples/s  final loss "
                          f"{r['final_loss']:.4f}  ({r['job_s']:.0f} s)", file=sys.stderr, flush=True)
    figures: dict[str, Any] = {}
    goals: dict[str, bool] = {}
    print(f"\nemulated speeds {[s * args.time_scale for s in SPEEDS]} (nominal x {args.time_scale}), per-device "
          f"batch {BATCH}, global batch {4 * BATCH}, {args.epochs} epoch(s), {args.pairs} pair(s)\n")
    print(f"| framework | arm | plan batches | rank batches | samples/s | steps | final loss |")
    print("|---|---|---|---|---|---|---|")
    for framework in frameworks:
        arms = {arm: [r for r in results if r["framework"] == framework and r["arm"] == arm]
                for arm in ("uniform", "planned")}
        median = {arm: statistics.median(r["samples_per_s"] for r in rs) for arm, rs in arms.items()}
        loss = {arm: statistics.median(r["final_loss"] for r in rs) for arm, rs in arms.items()}
        for arm, rs in arms.items():
            r = rs[0]
            print(f"| {framework} | {arm} | {'/'.join(map(str, r['plan_batches']))} | "
                  f"{'/'.join(map(str, r['shares']))} | {median[arm]:.1f} | {r['steps']} | {loss[arm]:.4f} |")
        speedup = median["planned"] / median["uniform"]
        loss_gap = abs(loss["planned"] - loss["uniform"]) / loss["uniform"]
        figures[framework] = {"uniform_samples_per_s": median["uniform"], "planned_samples_per_s": median["planned"],
                              "speedup": speedup, "uniform_final_loss": loss["uniform"],
                              "planned_final_loss": loss["planned"], "loss_gap": loss_gap,
                              "runs": [r for rs in arms.values() for r in rs]}
        goals[f"{framework}_planned_vs_uniform>={GOAL_SPEEDUP:g}"] = speedup >= GOAL_SPEEDUP
        goals[f"{framework}_final_loss_within_{GOAL_LOSS:.0%}"] = loss_gap <= GOAL_LOSS
    print()
    for framework, f in figures.items():
        print(f"{framework}: planned {f['speedup']:.2f} x uniform samples/s, final loss {f['planned_final_loss']:.4f} "
              f"against {f['uniform_final_loss']:.4f} ({f['loss_gap']:.1%} apart)")
    print(json.dumps({"benchmark": "frameworks", "speeds": list(SPEEDS), "time_scale": args.time_scale,
                      "batch": BATCH, "epochs": args.epochs, "pairs": args.pairs, "figures": figures, "goals": goals}))


if __name__ == "__main__":
    main()
