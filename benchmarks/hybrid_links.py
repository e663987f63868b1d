"""Hybrid communication at a realistic model size over a limited link: overlap and wire format (issue 16).

Two "nodes" are network namespaces joined by a veth pair rate-limited both ways with tc (tbf,
--link-rate, default 1gbit); the fast devices and the PS sit on node a, the slow ones on node b.
Four emulated devices [1, 1, 0.25, 0.25] train the MLP example (hgcli.examples.train_mlp) widened
to --hidden 600000: 25.8M parameters, 103 MB in fp32 (ResNet-50 is 25.6M), for one epoch of
--train-samples, batches proportional to speed, started as real processes by hgcli.local:
  allreduce-prop        one all-reduce group over both nodes, batch proportional to speed
  hybrid                a group per node + 1 PS rank on node a, no overlap, fp32 on the wire
  hybrid-overlap        the same, the leader's PS exchange overlapping its group's next step
  hybrid-bf16           no overlap, pushes and pulls in bf16
  hybrid-overlap-bf16   both
Time scaling: an emulated device at nominal speed s runs at s x --time-scale, i.e. every step's CPU
time is stretched by 1 / (s x time-scale), while the link runs at its real rate. At the defaults a
speed-1 device's step of 16 samples (0.2-0.4 s of CPU here) lasts 1-2 s, about what a 103 MB
transfer takes on the 1 Gbit/s link: the regime of a real cluster whose GPUs step a ResNet-50 in
about the time its slow link carries the parameters once.
Bytes on the link are the veth pair's transmit counters over each run, per trained sample.
Readable table, then one JSON line with every figure and the goals. Root only (namespaces, tc).

    PYTHONPATH=. .venv/bin/python benchmarks/hybrid_links.py
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_vs_allreduce import SPEEDS, slow_link, summarise, time_to_target  # noqa: E402

from hgcli.local.plans import emulated_plan  # noqa: E402
from hgcli.local.run import run_plan  # noqa: E402

STRATEGIES = ["allreduce-prop", "hybrid", "hybrid-overlap", "hybrid-bf16", "hybrid-overlap-bf16"]
NODES = ["a", "a", "b", "b"]


def plan_for(strategy: str, args: argparse.Namespace):
    speeds = [s * args.time_scale for s in SPEEDS]
    prop = [max(1, round(args.batch * s)) for s in SPEEDS]
    if strategy == "allreduce-prop":
        return emulated_plan([speeds], [prop], nodes=[NODES])
    return emulated_plan([speeds[:2], speeds[2:]], [prop[:2], prop[2:]], n_ps=1, staleness_bound=args.staleness,
                         nodes=[NODES[:2], NODES[2:]], ps_node="a", overlap="overlap" in strategy,
                         wire="bf16" if "bf16" in strategy else "fp32")


def link_bytes(net: dict[str, Any]) -> int:
    """Bytes both ends of the veth pair have transmitted so far."""
    total = 0
    for node, env in net["node_env"].items():
        dev = env["GLOO_SOCKET_IFNAME"]
        out = subprocess.run([*net["node_prefix"][node], "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"],
                             check=True, capture_output=True, text=True, timeout=30).stdout
        total += int(out.strip())
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=600_000, help="hidden width of the MLP (600000: 25.8M parameters)")
    p.add_argument("--batch", type=int, default=16, help="batch of a speed-1 device")
    p.add_argument("--train-samples", type=int, default=1600, help="one epoch of this many samples")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--target", type=float, default=0.70)
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--eval-samples", type=int, default=512)
    p.add_argument("--time-scale", type=float, default=0.2)
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--link-rate", default="1gbit")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="hgtrain-links-"))
    argv = [sys.executable, "-m", "hgcli.examples.train_mlp", "--epochs", "1", "--lr", str(args.lr),
            "--hidden", str(args.hidden), "--train-samples", str(args.train_samples),
            "--eval-every", str(args.eval_every), "--eval-samples", str(args.eval_samples),
            "--target", str(args.target)]
    params = 43 * args.hidden + 10
    runs: dict[str, dict[str, Any]] = {}
    load = {"before": os.getloadavg()[0]}
    with slow_link(args.link_rate) as net:
        for strategy in args.strategies.split(","):
            before, t0 = link_bytes(net), time.monotonic()
            res = run_plan(plan_for(strategy, args), argv, workdir=workdir / strategy, timeout_s=args.timeout, **net)
            r = summarise(res)
            r["wall_s"] = time.monotonic() - t0
            r["link_bytes"] = link_bytes(net) - before
            trained = sum(m["samples"] for m in res.metrics if "step" in m and "event" not in m)
            r["link_bytes_per_sample"] = r["link_bytes"] / max(trained, 1)
            r["load_1min"] = os.getloadavg()[0]
            runs[strategy] = r
            print(f"... {strategy}: {r}", file=sys.stderr, flush=True)
    load["after"] = os.getloadavg()[0]

    print(f"MLP of {params / 1e6:.1f}M parameters ({4 * params / 1e6:.0f} MB fp32); emulated devices {SPEEDS} x "
          f"time scale {args.time_scale}, nodes a [1, 1] + PS, b [0.25, 0.25], link {args.link_rate} each way; "
          f"batch per round {sum(max(1, round(args.batch * s)) for s in SPEEDS)}; one epoch of "
          f"{args.train_samples} samples; target {args.target}; S = {args.staleness}; load average "
          f"{load['before']:.1f} before, {load['after']:.1f} after (2 cores)")
    print(f"{'strategy':22} {'samples/s':>10} {'t->target s':>12} {'final acc':>10} {'MB/sample link':>15} "
          f"{'train s':>8}")
    for k, r in runs.items():
        print(f"{k:22} {r['samples_per_s']:10.2f} {time_to_target(r):>12} {r['final_accuracy']:10.4f} "
              f"{r['link_bytes_per_sample'] / 1e6:15.2f} {r['train_s']:8.1f}")
    ratios: dict[str, float | None] = {}
    base = runs.get("allreduce-prop")
    for k, r in runs.items():
        if base is None or k == "allreduce-prop":
            continue
        ratios[f"{k}_vs_prop"] = r["samples_per_s"] / base["samples_per_s"]
        ratios[f"{k}_acc_gap_points"] = 100 * (base["final_accuracy"] - r["final_accuracy"])
        ratios[f"{k}_tta_vs_prop"] = (r["time_to_target_s"] / base["time_to_target_s"]
                                      if r["time_to_target_s"] is not None and base["time_to_target_s"] else None)
    for k, v in ratios.items():
        print(f"{k:36} {v:.3f}" if isinstance(v, float) else f"{k:36} {v}")
    best = max((k for k in runs if k.startswith("hybrid-overlap")), key=lambda k: runs[k]["samples_per_s"],
               default=None)
    goals = {
        "hybrid_overlap_vs_prop>=1.1": None if best is None or base is None
        else runs[best]["samples_per_s"] >= 1.1 * base["samples_per_s"],
        "hybrid_overlap_acc_within_1_point": None if best is None or base is None
        else base["final_accuracy"] - runs[best]["final_accuracy"] <= 0.01,
    }
    print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED' if v is not None else 'n/a'}" for k, v in goals.items())
          + (f" (best overlapped run: {best})" if best else ""))
    print(json.dumps({"benchmark": "hybrid_links", "parameters": params, "speeds": SPEEDS,
                      "time_scale": args.time_scale, "link_rate": args.link_rate, "batch_speed1": args.batch,
                      "train_samples": args.train_samples, "target": args.target, "staleness": args.staleness,
                      "load": load, "runs": runs, "ratios": ratios, "goals": goals, "best_overlap": best}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
