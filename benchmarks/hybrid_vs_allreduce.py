"""Hybrid aggregation vs synchronous all-reduce on an emulated heterogeneous cluster (issue 4).

Every strategy trains the bundled example (same model, data, epochs, global batch per round) on four
emulated devices [1, 1, 0.25, 0.25] on this machine, started as real processes by localrun:
  allreduce-uniform  one group, the same batch on every device (what plain DDP does)
  allreduce-prop     one group, batch proportional to speed (the hand-tuned DDP baseline)
  hybrid             a group per speed class (batches proportional to speed) + 1 PS rank
Scenario 1: static speeds. Scenario 2: dynamic stragglers, every local step one pseudo-random worker
is 3x slower (HGTRAIN_EMULATE_STRAGGLER). Scenario 3 (root only): static speeds, the fast devices and
the PS on "node" a, the slow devices on "node" b: two network namespaces joined by a veth pair whose
both ends are rate-limited with tc (tbf, --link-rate).

The ideal is the sum of each device's own samples/s, each measured alone (one rank, no PS) at its
proportional batch, with the same emulation. All devices run on this machine's CPUs; the emulated
speeds are the nominal ones times --time-scale so that real compute stays a small part of each
emulated step (the share is printed). Readable table, then one JSON line with every figure.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from hgcli.local.plans import emulated_plan
from hgcli.local.run import run_plan

SPEEDS = [1.0, 1.0, 0.25, 0.25]


def train_argv(args: argparse.Namespace, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hgcli.examples.train_mlp", "--epochs", str(args.epochs), "--lr",
            str(args.lr), "--hidden", str(args.hidden), "--eval-every", str(args.eval_every),
            "--eval-samples", str(args.eval_samples),
            "--target", str(args.target), *extra]


def summarise(result: Any) -> dict[str, Any]:
    if not result.ok:
        bad = result.first_failure or result.ranks[0]
        raise SystemExit(f"run failed: rank {bad.rank} exit {bad.exit_code}\n{bad.output()[-3000:]}")
    steps = [m for m in result.metrics if "step" in m and "event" not in m]
    first = {}
    for m in steps:
        first.setdefault(m["rank"], m["time"])
    counted = [m for m in steps if m["time"] > first[m["rank"]]]   # each rank's first step is warm-up
    t0, t1 = min(first.values()), max(m["time"] for m in steps)
    evals = sorted((m for m in result.metrics if m.get("event") == "eval"), key=lambda m: m["elapsed_s"])
    final = [m for m in result.metrics if m.get("event") == "final"]
    fins = [m for m in result.metrics if m.get("event") == "finish"]
    compute = sum(m["compute_s"] for m in fins)
    slept = sum(m["emulated_sleep_s"] for m in fins)
    return {
        "samples_per_s": sum(m["samples"] for m in counted) / (t1 - t0),
        "time_to_target_s": final[0]["time_to_target_s"] if final else None,
        "final_accuracy": final[0]["accuracy"] if final else None,
        "train_s": t1 - t0,
        "compute_share": compute / (compute + slept) if compute + slept else None,
        "evals": len(evals),
    }


def ideal(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Each device type's own samples/s, alone, at its proportional batch (both twins count)."""
    per_device = {}
    for speed in sorted(set(SPEEDS), reverse=True):
        batch = max(1, round(args.batch * speed))
        plan = emulated_plan([[speed * args.time_scale]], [[batch]])
        res = run_plan(plan, train_argv(args, "--max-steps", str(args.ideal_steps), "--eval-every", "1000000"),
                       workdir=workdir / f"ideal-{speed}", timeout_s=args.timeout)
        per_device[f"speed_{speed}"] = summarise(res)["samples_per_s"]
    return per_device


def plan_for(strategy: str, args: argparse.Namespace, two_nodes: bool = False):
    speeds = [s * args.time_scale for s in SPEEDS]
    prop = [max(1, round(args.batch * s)) for s in SPEEDS]
    nodes = ["a", "a", "b", "b"] if two_nodes else ["local"] * 4
    if strategy == "allreduce-uniform":
        return emulated_plan([speeds], [[sum(prop) // len(prop)] * len(prop)], nodes=[nodes])
    if strategy == "allreduce-prop":
        return emulated_plan([speeds], [prop], nodes=[nodes])
    return emulated_plan([speeds[:2], speeds[2:]], [prop[:2], prop[2:]], n_ps=1,
                         accumulate=[args.accumulate, args.accumulate], staleness_bound=args.staleness,
                         nodes=[nodes[:2], nodes[2:]], ps_node=nodes[0])


@contextlib.contextmanager
def slow_link(rate: str) -> Iterator[dict[str, Any]]:
    """Two namespaces "a" and "b" joined by a veth pair rate-limited both ways; removed afterwards."""
    tag = str(os.getpid() % 100000)
    ns = {"a": f"hgta{tag}", "b": f"hgtb{tag}"}
    dev = {"a": f"hgva{tag}", "b": f"hgvb{tag}"}
    addr = {"a": "10.213.0.1", "b": "10.213.0.2"}

    def sh(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, timeout=30)

    try:
        for n in "ab":
            sh("ip", "netns", "add", ns[n])
        sh("ip", "link", "add", dev["a"], "type", "veth", "peer", "name", dev["b"])
        for n in "ab":
            sh("ip", "link", "set", dev[n], "netns", ns[n])
            sh("ip", "-n", ns[n], "addr", "add", f"{addr[n]}/24", "dev", dev[n])
            sh("ip", "-n", ns[n], "link", "set", dev[n], "up")
            sh("ip", "-n", ns[n], "link", "set", "lo", "up")
            sh("tc", "-n", ns[n], "qdisc", "add", "dev", dev[n], "root", "tbf", "rate", rate,
               "burst", "256kb", "latency", "200ms")
        yield {"master_addr": addr["a"],
               "node_prefix": {n: ["ip", "netns", "exec", ns[n]] for n in "ab"},
               "node_env": {n: {"GLOO_SOCKET_IFNAME": dev[n], "TP_SOCKET_IFNAME": dev[n]} for n in "ab"}}
    finally:
        for n in "ab":
            subprocess.run(["ip", "netns", "del", ns[n]], capture_output=True, timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=102, help="batch of a speed-1 device")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--target", type=float, default=0.92)
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--eval-samples", type=int, default=1024)
    p.add_argument("--time-scale", type=float, default=0.07,
                   help="emulated speed = nominal speed x this (makes steps long against compute)")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--ideal-steps", type=int, default=40)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--scenarios", default="1,2",
                   help="1 static, 2 stragglers, 3 slow link (root: network namespaces; ~5 more minutes)")
    p.add_argument("--link-rate", default="50mbit", help="tc rate of the slow link (scenario 3)")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="hgtrain-bench-"))
    devices = ideal(args, workdir)
    ideal_sps = sum(devices[f"speed_{s}"] for s in SPEEDS)
    runs: dict[str, dict[str, Any]] = {}
    scenarios = {"1": ("static", {}, ["allreduce-uniform", "allreduce-prop", "hybrid"]),
                 "2": ("stragglers", {"HGTRAIN_EMULATE_STRAGGLER": "3", "HGTRAIN_EMULATE_SEED": "7"},
                       ["allreduce-uniform", "allreduce-prop", "hybrid"])}
    for key in args.scenarios.split(","):
        if key == "3":
            with slow_link(args.link_rate) as net:
                for strategy in ["allreduce-uniform", "allreduce-prop", "hybrid"]:
                    res = run_plan(plan_for(strategy, args, two_nodes=True), train_argv(args),
                                   workdir=workdir / f"slowlink-{strategy}", timeout_s=args.timeout, **net)
                    runs[f"slowlink/{strategy}"] = summarise(res)
                    print(f"... slowlink/{strategy}: {runs[f'slowlink/{strategy}']}", file=sys.stderr,
                          flush=True)
            continue
        name, env, strategies = scenarios[key]
        for strategy in strategies:
            res = run_plan(plan_for(strategy, args), train_argv(args), workdir=workdir / f"{name}-{strategy}",
                           timeout_s=args.timeout, extra_env=env)
            runs[f"{name}/{strategy}"] = summarise(res)
            print(f"... {name}/{strategy}: {runs[f'{name}/{strategy}']}", file=sys.stderr, flush=True)

    print(f"emulated devices {SPEEDS} x time scale {args.time_scale}; batch per round "
          f"{sum(max(1, round(args.batch * s)) for s in SPEEDS)}; {args.epochs} epochs; target "
          f"accuracy {args.target}")
    print("ideal (each device alone, samples/s): "
          + ", ".join(f"{k} {v:.0f}" for k, v in devices.items()) + f"; sum over 4 devices {ideal_sps:.0f}")
    print(f"{'scenario/strategy':32} {'samples/s':>10} {'x ideal':>8} {'t->target s':>12} "
          f"{'final acc':>10} {'train s':>8} {'compute share':>14}")
    for k, r in runs.items():
        tta = time_to_target(r)
        print(f"{k:32} {r['samples_per_s']:10.0f} {r['samples_per_s'] / ideal_sps:8.2f} {tta:>12} "
              f"{r['final_accuracy']:10.4f} {r['train_s']:8.1f} {r['compute_share']:14.2f}")
    ratios: dict[str, Any] = {}
    if "static/hybrid" in runs:
        h, u, pr = runs["static/hybrid"], runs["static/allreduce-uniform"], runs["static/allreduce-prop"]
        ratios["s1_hybrid_vs_ideal"] = h["samples_per_s"] / ideal_sps
        ratios["s1_hybrid_vs_uniform"] = h["samples_per_s"] / u["samples_per_s"]
        ratios["s1_hybrid_vs_prop"] = h["samples_per_s"] / pr["samples_per_s"]
        ratios["s1_tta_hybrid_vs_uniform"] = _ratio(h["time_to_target_s"], u["time_to_target_s"])
        ratios["s1_acc_gap_vs_prop_points"] = 100 * (pr["final_accuracy"] - h["final_accuracy"])
        ratios["s1_acc_gap_vs_uniform_points"] = 100 * (u["final_accuracy"] - h["final_accuracy"])
    for tag, name in (("s2", "stragglers"), ("s3", "slowlink")):
        if f"{name}/hybrid" in runs:
            h, pr, u = (runs[f"{name}/{k}"] for k in ("hybrid", "allreduce-prop", "allreduce-uniform"))
            ratios[f"{tag}_hybrid_vs_prop"] = h["samples_per_s"] / pr["samples_per_s"]
            ratios[f"{tag}_tta_hybrid_vs_uniform"] = _ratio(h["time_to_target_s"], u["time_to_target_s"])
            ratios[f"{tag}_acc_gap_vs_prop_points"] = 100 * (pr["final_accuracy"] - h["final_accuracy"])
    goals = {
        "s1_hybrid_vs_ideal>=0.85": _ge(ratios.get("s1_hybrid_vs_ideal"), 0.85),
        "s1_hybrid_vs_uniform>=1.8": _ge(ratios.get("s1_hybrid_vs_uniform"), 1.8),
        "s2_hybrid_vs_prop>=1.3": _ge(ratios.get("s2_hybrid_vs_prop"), 1.3),
        "s1_tta_hybrid_vs_uniform<=0.6": _le(ratios.get("s1_tta_hybrid_vs_uniform"), 0.6),
        "s1_acc_within_1_point": _le(ratios.get("s1_acc_gap_vs_prop_points"), 1.0),
        "s2_acc_within_1_point": _le(ratios.get("s2_acc_gap_vs_prop_points"), 1.0),
    }
    for k, v in ratios.items():
        print(f"{k:36} {v:.3f}" if isinstance(v, float) else f"{k:36} {v}")
    print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED' if v is not None else 'n/a'}"
                                for k, v in goals.items()))
    print(json.dumps({"benchmark": "hybrid_vs_allreduce", "speeds": SPEEDS, "time_scale": args.time_scale,
                      "epochs": args.epochs, "batch_speed1": args.batch, "ideal_samples_per_s": ideal_sps,
                      "ideal_per_device": devices, "runs": runs, "ratios": ratios, "goals": goals,
                      "link_rate": args.link_rate if "3" in args.scenarios.split(",") else None}))
    return 0


def time_to_target(run: dict[str, Any]) -> str:
    return f"{run['time_to_target_s']:.1f}" if run["time_to_target_s"] is not None else "not reached"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ge(v: float | None, bound: float) -> bool | None:
    return None if v is None else v >= bound


def _le(v: float | None, bound: float) -> bool | None:
    return None if v is None else v <= bound


if __name__ == "__main__":
    sys.exit(main())
