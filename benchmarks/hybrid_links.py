"""Hybrid communication at a realistic model size over a limited link: the planner's plans, overlap, wire (issue 16).

Two "nodes" are network namespaces joined by a veth pair rate-limited both ways with tc (tbf,
--link-rate, default 1gbit); the fast devices and the PS sit on node a, the slow ones on node b.
Four emulated devices [1, 1, 0.25, 0.25] train the MLP example (hgcli.examples.train_mlp) widened
to --hidden 600000: 25.8M parameters, 103 MB in fp32 (ResNet-50 is 25.6M), for one epoch of
--train-samples, started as real processes by hgcli.local. Strategies (default: the first four):
  allreduce-prop        one all-reduce group over both nodes, batch proportional to speed (by hand)
  planned-auto          the planner's plan (hgcli.plan.placement.make_plan) of --strategy auto
  planned-hybrid        the planner's plan of --strategy hybrid (its groups, batches, accumulation, S)
  planned-allreduce     the planner's plan of --strategy allreduce
  hybrid                by hand: a group per node + 1 PS rank on node a, each pushing every step,
                        no overlap, fp32 on the wire
  hybrid-overlap        the same, the leader's PS exchange overlapping its group's next step
  hybrid-bf16           no overlap, pushes and pulls in bf16
  hybrid-overlap-bf16   both
Time scaling: an emulated device at nominal speed s runs at s x --time-scale, i.e. every step's CPU
time is stretched by 1 / (s x time-scale), while the link runs at its real rate. At the defaults a
speed-1 device's step of 16 samples (0.2-0.4 s of CPU here) lasts 1-2 s, about what a 103 MB
transfer takes on the 1 Gbit/s link: the regime of a real cluster whose GPUs step a ResNet-50 in
about the time its slow link carries the parameters once.
Bytes on the link are the veth pair's transmit counters over each run, per trained sample.

The planner's inputs are measured here, the way ``hgtrain bench`` measures them: two local nodes
"a" and "b" declaring the emulated devices at their scaled speeds are probed (``probe_cluster``:
cpu_cores as this machine has) and benched (``bench_cluster --quick`` of this MLP at several
batches: emulated step times, the PS exchange of this model size, each node's synchronous group
step); the a<->b link is then measured with hgtrain's link bench (``hgcli.node.bench.link``) run
inside the two namespaces, over the rate-limited veth pair (the loopback figure the local bench
took for it is replaced). --profiles FILE reuses an earlier run's measured inputs (written to the
run's directory as profiles.json). A planned strategy whose plan is identical to one already run
(auto is one of the others) is run once and reported under both names. Each planned run's
predicted samples/s is printed with its error, also against the samples/s less rank 0's
evaluation pauses (``eval_pauses``: the cost model prices training steps only); each run's
metrics.jsonl stays in its directory.
Readable table, then one JSON line with every figure and the goals. Root only (namespaces, tc).

    PYTHONPATH=. .venv/bin/python benchmarks/hybrid_links.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_vs_allreduce import SPEEDS, slow_link, summarise, time_to_target  # noqa: E402

from hgcli.local.plans import emulated_plan  # noqa: E402
from hgcli.local.run import run_plan  # noqa: E402
from hgcli.bench.links import link_profile  # noqa: E402
from hgcli.node import frames  # noqa: E402
from hgcli.schema import stages as m  # noqa: E402

PLANNED = ["planned-auto", "planned-hybrid", "planned-allreduce"]
HAND = ["hybrid", "hybrid-overlap", "hybrid-bf16", "hybrid-overlap-bf16"]
DEFAULT = ["allreduce-prop", "planned-hybrid", "planned-allreduce", "planned-auto"]
NODES = ["a", "a", "b", "b"]
MEMORY_MIB = 16384
AUTO_TOLERANCE = 0.05   # the planner's own AUTO_MARGIN: it does not claim to tell closer strategies apart


def measure_inputs(args: argparse.Namespace, net: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Inventory and Profiles of nodes a and b, measured (see the module's docstring)."""
    from hgcli.bench.cluster import bench_cluster
    from hgcli.probe.inventory import probe_cluster

    factory = workdir / f"mlp_h{args.hidden}.py"
    factory.write_text("from hgcli.examples.models import example\n\n\n"
                       f"def factory():\n    return example(hidden={args.hidden})\n")
    nodes = []
    for name in "ab":
        speeds = tuple(s * args.time_scale for s, n in zip(SPEEDS, NODES) if n == name)
        emulate = m.EmulateSpec(devices=tuple(f"emu-x{s / args.time_scale:g}" for s in speeds), speed=speeds,
                                memory_mib=(MEMORY_MIB,) * len(speeds))
        nodes.append(m.NodeSpec(name=name, host="localhost", python=sys.executable, emulate=emulate))
    cluster = m.Cluster(nodes=tuple(nodes))
    inventory = probe_cluster(cluster)
    if not all(n.ok for n in inventory.nodes):
        raise SystemExit(f"probe failed: {[n.error for n in inventory.nodes]}")
    profiles = bench_cluster(cluster, inventory, quick=True,
                             model_spec=f"{factory}:factory@{args.bench_batches}")
    bad = [d.error for d in profiles.devices if d.error]
    if bad:
        raise SystemExit(f"bench failed: {bad}")
    link, source = namespace_link(net), "measured (hgcli.node.bench.link between the namespaces)"
    if link.error:
        print(f"... link bench failed ({link.error}); the planner gets the tc rate", file=sys.stderr)
        link, source = configured_link(args.link_rate), f"tc rate as configured ({args.link_rate})"
    links = tuple(x for x in profiles.links if {x.a, x.b} != {"a", "b"}) + (link,)
    return {"inventory": inventory, "profiles": replace(profiles, links=links), "link_source": source}


def namespace_link(net: dict[str, Any]) -> m.LinkProfile:
    """hgtrain's link bench (full size), rank 0 in namespace a, rank 1 in b, over the veth pair."""
    common = ["--addr", net["master_addr"], "--backend", "gloo", "--timeout", "60"]

    def start(node: str, *extra: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([*net["node_prefix"][node], sys.executable, "-m", "hgcli.node.bench.link",
                                 *extra, *common], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env={**os.environ, **net["node_env"][node]})

    rank0 = start("a", "--rank", "0")
    rank1 = None
    try:
        assert rank0.stdout is not None
        result: dict[str, Any] = {}
        for frame in frames.read_stream(rank0.stdout):
            if frame.get("type") == "listening":
                rank1 = start("b", "--rank", "1", "--port", str(frame["port"]))
            elif frame.get("type") in ("link", "error"):
                result = frame
        if result.get("type") != "link":
            return m.LinkProfile("a", "b", "gloo", error=str(result.get("message", "no result")))
        return link_profile("a", "b", "gloo", result)
    finally:
        for proc in (rank0, rank1):
            if proc is not None:
                try:
                    proc.wait(timeout=200)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def configured_link(rate: str) -> m.LinkProfile:
    """The tc rate as the link's bandwidth (fallback when the link bench fails)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    unit = next(u for u in units if rate.endswith(u))
    gbs = float(rate[:-len(unit)]) * units[unit] / 8 / 1e9
    return m.LinkProfile("a", "b", "gloo", bandwidth_gbs=m.Measurement(gbs, gbs, gbs, 1),
                         latency_s=m.Measurement(1e-4, 1e-4, 1e-4, 1))


def save_inputs(inputs: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps({"inventory": m.to_dict(inputs["inventory"]), "profiles": m.to_dict(inputs["profiles"]),
                                "link_source": inputs["link_source"]}), encoding="utf-8")


def load_inputs(path: Path) -> dict[str, Any]:
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {"inventory": m.from_dict(m.Inventory, raw["inventory"]),
            "profiles": m.from_dict(m.Profiles, raw["profiles"]), "link_source": raw["link_source"] + ", reused"}


def planned(strategy: str, inputs: dict[str, Any], args: argparse.Namespace) -> m.Plan:
    from hgcli.plan.placement import make_plan

    kind = m.Strategy(strategy.removeprefix("planned-"))
    return make_plan(inputs["inventory"], inputs["profiles"], m.JobSpec(strategy=kind, global_batch=args.global_batch))


def layout(plan: m.Plan) -> str:
    """Groups as batches per rank, x accumulation; PS ranks; staleness bound."""
    by_rank = {r.rank: r for r in plan.ranks}
    groups = " + ".join("[" + ",".join(str(by_rank[r].batch_size) for r in g.ranks) + "]"
                        + (f"x{g.accumulate}" if g.accumulate > 1 else "") for g in plan.groups)
    return groups + (f", {len(plan.ps_shards)} PS, S={plan.staleness_bound}" if plan.ps_shards else "")


def describe_inputs(inputs: dict[str, Any]) -> str:
    """The measured figures the planner got, in one line."""
    profiles = inputs["profiles"]
    parts = []
    for d in profiles.devices:
        steps = ", ".join(f"{s.batch_size}: {1e3 * s.seconds.median:.0f}" for s in d.steps)
        parts.append(f"{d.node}/{d.device} x{d.speed:g} step ms {{{steps}}}")
    for name in "ab":
        d = next(d for d in profiles.devices if d.node == name)
        if d.exchange:
            parts.append(f"{name} exchange {1e3 * d.exchange.round_trip_s.median:.0f} ms "
                         f"(PS service {1e3 * d.exchange.service_s.median:.0f} ms)")
        if d.group_sync:
            parts.append(f"{name} group all-reduce {1e3 * d.group_sync.seconds.median:.0f} ms")
    for x in profiles.links:
        if x.bandwidth_gbs:
            parts.append(f"link {x.a}<->{x.b} {x.bandwidth_gbs.median:.3f} GB/s")
    cores = {n.name: n.cpu_cores for n in inputs["inventory"].nodes}
    return "; ".join(parts) + f"; cpu_cores {cores}; a<->b link {inputs['link_source']}"


def eval_pauses(metrics: list[dict[str, Any]], every: int) -> float:
    """Seconds rank 0's evaluations (every ``every`` steps) held up its steps: what the step into
    each evaluated step took beyond the median of the other steps of its parity (a hybrid group that
    accumulates 2 steps alternates short and synchronising steps). The cost model prices training
    steps only; the benchmark's evaluations pause rank 0 and whatever waits for it."""
    times = sorted((m["step"], m["time"]) for m in metrics if m.get("rank") == 0 and "step" in m and "event" not in m)
    gaps = {step: t - before for (_, before), (step, t) in zip(times, times[1:])}
    pause = 0.0
    for step, gap in gaps.items():
        if step % every == 0:
            like = [g for k, g in gaps.items() if k % every and k % 2 == step % 2]
            pause += max(0.0, gap - statistics.median(like)) if like else 0.0
    return pause


def judge_auto(runs: dict[str, dict[str, Any]], plans: dict[str, m.Plan]) -> dict[str, Any] | None:
    """Whether auto's plan measured within AUTO_TOLERANCE of the fastest run."""
    if "planned-auto" not in runs:
        return None
    best = max(runs, key=lambda k: runs[k]["samples_per_s"])
    gap = 1 - runs["planned-auto"]["samples_per_s"] / runs[best]["samples_per_s"]
    return {"chose": plans["planned-auto"].strategy.value, "plan": layout(plans["planned-auto"]), "best": best,
            "gap": gap, "ok": gap <= AUTO_TOLERANCE}


def _same_plan(a: m.Plan, b: m.Plan) -> bool:
    """The same ranks, groups and settings: only the planner's reason (and requested strategy) differ."""
    def key(p: m.Plan) -> dict[str, Any]:
        return {k: v for k, v in m.to_dict(p).items() if k not in ("reason",)}

    return key(a) == key(b)


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
    p.add_argument("--strategies", default=",".join(DEFAULT),
                   help=f"comma-separated, of: allreduce-prop, {', '.join(PLANNED)}, {', '.join(HAND)}")
    p.add_argument("--global-batch", type=int, default=40,
                   help="the planned strategies' samples per step over all workers (the hand-built: 40)")
    p.add_argument("--bench-batches", default="2,4,8,16,32", help="batches the bench times the model at")
    p.add_argument("--profiles", type=Path, help="reuse the measured planner inputs of an earlier run")
    args = p.parse_args()
    strategies = args.strategies.split(",")
    unknown = set(strategies) - {"allreduce-prop", *PLANNED, *HAND}
    if unknown:
        p.error(f"unknown strategies: {', '.join(sorted(unknown))}")
    workdir = Path(tempfile.mkdtemp(prefix="hgtrain-links-"))
    argv = [sys.executable, "-m", "hgcli.examples.train_mlp", "--epochs", "1", "--lr", str(args.lr),
            "--hidden", str(args.hidden), "--train-samples", str(args.train_samples),
            "--eval-every", str(args.eval_every), "--eval-samples", str(args.eval_samples),
            "--target", str(args.target)]
    params = 43 * args.hidden + 10
    runs: dict[str, dict[str, Any]] = {}
    load = {"before": os.getloadavg()[0]}
    inputs: dict[str, Any] | None = None
    plans: dict[str, m.Plan] = {}
    with slow_link(args.link_rate) as net:
        if any(s in PLANNED for s in strategies):
            os.environ.setdefault("HGTRAIN_STATE_DIR", str(workdir / "state"))   # not the user's profiles
            inputs = load_inputs(args.profiles) if args.profiles else measure_inputs(args, net, workdir)
            save_inputs(inputs, workdir / "profiles.json")
            load["after_bench"] = os.getloadavg()[0]
            print(f"... planner inputs in {workdir / 'profiles.json'}; link: {inputs['link_source']}",
                  file=sys.stderr, flush=True)
        # auto's plan is one of the others': run those first so that it is run once
        for strategy in sorted(strategies, key=lambda s: s == "planned-auto"):
            plan = planned(strategy, inputs, args) if inputs is not None and strategy in PLANNED \
                else plan_for(strategy, args)
            same = next((k for k, q in plans.items() if _same_plan(q, plan)), None)
            plans[strategy] = plan
            if same is not None:
                runs[strategy] = {**runs[same], "same_plan_as": same}
                continue
            before, t0 = link_bytes(net), time.monotonic()
            res = run_plan(plan, argv, workdir=workdir / strategy, timeout_s=args.timeout, **net)
            with open(workdir / strategy / "metrics.jsonl", "w", encoding="utf-8") as fh:   # per-step terms
                fh.writelines(json.dumps(x) + "\n" for x in res.metrics)
            r = summarise(res)
            r["wall_s"] = time.monotonic() - t0
            r["link_bytes"] = link_bytes(net) - before
            trained = sum(m["samples"] for m in res.metrics if "step" in m and "event" not in m)
            r["link_bytes_per_sample"] = r["link_bytes"] / max(trained, 1)
            r["load_1min"] = os.getloadavg()[0]
            r["eval_pause_s"] = eval_pauses(res.metrics, args.eval_every)
            r["samples_per_s_without_evals"] = r["samples_per_s"] * r["train_s"] / (r["train_s"] - r["eval_pause_s"])
            if plan.predicted_samples_per_s:
                r["predicted_samples_per_s"] = plan.predicted_samples_per_s[plan.strategy.value]
                r["prediction_error"] = r["predicted_samples_per_s"] / r["samples_per_s"] - 1
                r["prediction_error_without_evals"] = (r["predicted_samples_per_s"] / r["samples_per_s_without_evals"]
                                                       - 1)
            r["layout"] = layout(plan)
            runs[strategy] = r
            print(f"... {strategy}: {r}", file=sys.stderr, flush=True)
    load["after"] = os.getloadavg()[0]

    print(f"MLP of {params / 1e6:.1f}M parameters ({4 * params / 1e6:.0f} MB fp32); emulated devices {SPEEDS} x "
          f"time scale {args.time_scale}, nodes a [1, 1] + PS, b [0.25, 0.25], link {args.link_rate} each way; "
          f"by hand: batch per round {sum(max(1, round(args.batch * s)) for s in SPEEDS)}, S = {args.staleness}; "
          f"planned: global batch {args.global_batch}; one epoch of {args.train_samples} samples; target "
          f"{args.target}; load average " + ", ".join(f"{v:.1f} {k}" for k, v in load.items()) + " (2 cores)")
    if inputs is not None:
        print(f"planner inputs: {describe_inputs(inputs)}")
    print(f"{'strategy':20} {'layout':28} {'samples/s':>10} {'predicted':>10} {'error':>7} {'w/o evals':>10} "
          f"{'error':>7} {'t->target s':>12} {'final acc':>10} {'MB/sample link':>15} {'train s':>8} {'load':>5}")
    for k, r in runs.items():
        pred, err = r.get("predicted_samples_per_s"), r.get("prediction_error")
        err2 = r.get("prediction_error_without_evals")
        print(f"{k:20} {r['layout']:28} {r['samples_per_s']:10.2f} "
              f"{'' if pred is None else f'{pred:.2f}':>10} {'' if err is None else f'{err:+.1%}':>7} "
              f"{r['samples_per_s_without_evals']:10.2f} {'' if err2 is None else f'{err2:+.1%}':>7} "
              f"{time_to_target(r):>12} {r['final_accuracy']:10.4f} "
              f"{r['link_bytes_per_sample'] / 1e6:15.2f} {r['train_s']:8.1f} {r['load_1min']:5.1f}"
              + (f"  (the plan of {r['same_plan_as']}, run once)" if "same_plan_as" in r else ""))
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
    auto = judge_auto(runs, plans)
    if auto:
        print(f"auto chose {auto['chose']} ({auto['plan']}), measured best {auto['best']}: auto "
              f"{auto['gap']:.1%} below it (tolerance {AUTO_TOLERANCE:.0%}): {'yes' if auto['ok'] else 'NO'}")
    best = max((k for k in runs if k.startswith(("hybrid", "planned-hybrid"))), key=lambda k: runs[k]["samples_per_s"],
               default=None)
    goals = {
        "hybrid_vs_prop>=1.1": None if best is None or base is None
        else runs[best]["samples_per_s"] >= 1.1 * base["samples_per_s"],
        "hybrid_acc_within_1_point": None if best is None or base is None
        else base["final_accuracy"] - runs[best]["final_accuracy"] <= 0.01,
        "auto_chose_measured_best": auto["ok"] if auto else None,
    }
    print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED' if v is not None else 'n/a'}" for k, v in goals.items())
          + (f" (fastest hybrid run: {best})" if best else ""))
    print(json.dumps({"benchmark": "hybrid_links", "parameters": params, "speeds": SPEEDS,
                      "time_scale": args.time_scale, "link_rate": args.link_rate, "batch_speed1": args.batch,
                      "global_batch": args.global_batch, "train_samples": args.train_samples,
                      "target": args.target, "staleness": args.staleness, "load": load,
                      "link_source": inputs["link_source"] if inputs else None, "runs": runs, "ratios": ratios,
                      "auto": auto, "goals": goals, "best_hybrid": best,
                      "plans": {k: m.to_dict(v) for k, v in plans.items()}, "workdir": str(workdir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
