"""How long the planner takes on large synthetic clusters.

Goal (issue 3): 4096 devices on 512 nodes plan in under 1 s on the development machine, and the
time grows no worse than n log n. Clusters: 8 devices per node, four device models (node i holds
model i % 4), racks of 32 nodes, a 25M-parameter model. Two link layouts:
- "sparse": each node measured to its next 4 rack neighbours and to the same slot in the next rack
  (about 5 links per node, what a bench can afford at scale): the growth figures use this one;
- "all pairs": every node pair measured (130,816 links on 512 nodes): the input itself grows with
  nodes^2, so only its 4096-device time is held to the goal.
Each figure is the best of a few runs of make_plan (building the inputs is not timed), in CPU seconds
of this process (the development machine is shared by several jobs, so wall time measures the
neighbours too; wall seconds are printed alongside).
Usage: python3 benchmarks/planner_scale.py [--repeats N]
Prints a readable table, then as its last line one JSON object with every figure and ratio.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hgcli.schema.stages import (  # noqa: E402  (after the path set-up above)
    DeviceProfile, GpuInfo, Inventory, JobSpec, LinkProfile, Measurement, ModelSpec, NodeInfo, Profiles,
    StepSample, Strategy,
)
from hgcli.plan.placement import make_plan  # noqa: E402

SIZES = ((8, 64), (64, 512), (512, 4096))   # (nodes, devices)
PER_NODE = 8
# name, relative speed, memory MiB: four generations of accelerator
MODELS = (("A100-40GB", 1.0, 40960), ("V100-32GB", 0.55, 32768), ("RTX-3090", 0.45, 24576), ("T4", 0.2, 15360))
STRATEGIES = ("auto", "allreduce", "hybrid", "ps")
RACK = 32
GOAL_S = 1.0


def measured(x: float) -> Measurement:
    return Measurement(median=x, min=x, max=x, repeats=5)


def synthetic(nodes: int, all_pairs: bool, seed: int = 0) -> tuple[Inventory, Profiles]:
    rng = random.Random(seed)
    infos, devices, links = [], [], []
    for i in range(nodes):
        name, speed, memory = MODELS[i % len(MODELS)]
        gpus = tuple(GpuInfo(j, name, memory_total_mib=memory, emulated=True, speed=speed) for j in range(PER_NODE))
        infos.append(NodeInfo(f"node{i:03d}", f"10.0.{i // 256}.{i % 256}", True, emulated=True, gpus=gpus,
                              cpu_cores=64))
        for j in range(PER_NODE):
            noise = rng.uniform(0.97, 1.03)
            steps = tuple(StepSample(b, measured((0.01 + 0.002 * b) * noise / speed), 2000 + 120 * b)
                          for b in (16, 64, 128))
            devices.append(DeviceProfile(f"node{i:03d}", f"gpu{j}", name, True, speed, memory, steps=steps))
    for a, b in node_pairs(nodes, all_pairs):
        same_rack = a // RACK == b // RACK
        gbs = rng.uniform(10.0, 12.5) if same_rack else rng.uniform(1.0, 3.0)
        links.append(LinkProfile(f"node{a:03d}", f"node{b:03d}", "nccl", measured(gbs), measured(20e-6)))
    model = ModelSpec("resnet50-like", 25_557_032)
    return Inventory("bench", tuple(infos)), Profiles("bench", tuple(devices), tuple(links), model)


def node_pairs(nodes: int, all_pairs: bool) -> list[tuple[int, int]]:
    if all_pairs:
        return [(a, b) for a in range(nodes) for b in range(a + 1, nodes)]
    pairs = set()
    for a in range(nodes):
        rack = a - a % RACK
        for k in range(1, 5):
            b = rack + (a - rack + k) % RACK
            if b < nodes and b != a:
                pairs.add((min(a, b), max(a, b)))
        if a + RACK < nodes:
            pairs.add((a, a + RACK))
    return sorted(pairs)


def best_time(inventory: Inventory, profiles: Profiles, strategy: str,
              repeats: int) -> tuple[float, float, str]:
    """(best CPU seconds, best wall seconds, the strategy the plan chose)."""
    job = JobSpec(strategy=Strategy(strategy), global_batch=64 * sum(len(n.gpus) for n in inventory.nodes))
    cpu, wall, chosen = math.inf, math.inf, ""
    for _ in range(repeats):
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        plan = make_plan(inventory, profiles, job)
        cpu = min(cpu, time.process_time() - start_cpu)
        wall = min(wall, time.perf_counter() - start_wall)
        chosen = plan.strategy.value
    return cpu, wall, chosen


def measure(layout: str, sizes: tuple[tuple[int, int], ...], repeats: int) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for nodes, devices in sizes:
        inventory, profiles = synthetic(nodes, all_pairs=layout == "all pairs")
        row: dict = {"nodes": nodes, "links": len(profiles.links), "cpu_s": {}, "wall_s": {}}
        for strategy in STRATEGIES:
            row["cpu_s"][strategy], row["wall_s"][strategy], pick = best_time(inventory, profiles, strategy,
                                                                              repeats)
            if strategy == "auto":
                row["auto_picks"] = pick
        rows[str(devices)] = row
        print(f"{layout:>9} {devices:>8} {nodes:>6} {row['links']:>7} "
              + " ".join(f"{row['cpu_s'][s]:>11.4f}" for s in STRATEGIES)
              + f" {max(row['wall_s'].values()):>11.4f}  {row['auto_picks']}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'links':>9} {'devices':>8} {'nodes':>6} {'links':>7} " + " ".join(f"{s + ' cpu s':>11}" for s in STRATEGIES)
          + f" {'max wall s':>11}  auto picks")
    sparse = measure("sparse", SIZES, args.repeats)
    dense = measure("all pairs", SIZES[-1:], args.repeats)
    print()
    print("growth per 8x devices, sparse links (CPU time ratio; n log n allows 8 x log(8n)/log(n)):")
    growth: dict[str, dict[str, float]] = {}
    for (_, small), (_, large) in zip(SIZES, SIZES[1:]):
        bound = 8 * math.log(large) / math.log(small)
        ratios = {s: sparse[str(large)]["cpu_s"][s] / sparse[str(small)]["cpu_s"][s] for s in STRATEGIES}
        growth[f"{small}->{large}"] = {**ratios, "nlogn_bound": bound}
        print(f"  {small:>5} -> {large:<5} " + "  ".join(f"{s} {ratios[s]:.2f}" for s in STRATEGIES)
              + f"  (bound {bound:.2f})")
    largest = str(SIZES[-1][1])
    worst = {"sparse": max(sparse[largest]["cpu_s"].values()), "all pairs": max(dense[largest]["cpu_s"].values())}
    goal_met = all(w < GOAL_S for w in worst.values())
    growth_ok = all(g[s] <= g["nlogn_bound"] for g in growth.values() for s in STRATEGIES)
    print(f"\n{largest} devices, slowest strategy: {worst['sparse']:.3f} CPU s with sparse links, "
          f"{worst['all pairs']:.3f} CPU s with all {dense[largest]['links']} pairs (goal < {GOAL_S} s): "
          f"{'met' if goal_met else 'MISSED'}; growth within n log n: {'yes' if growth_ok else 'NO'}")
    print(json.dumps({"sparse": sparse, "all_pairs": dense, "growth": growth, "goal_s": GOAL_S,
                      "largest_worst_cpu_s": worst, "goal_met": goal_met, "growth_within_nlogn": growth_ok,
                      "repeats": args.repeats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
