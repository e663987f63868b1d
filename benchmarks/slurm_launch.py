"""Launch latency inside a Slurm allocation: ``hgtrain launch`` (srun transport) vs ``srun python script``.

    PYTHONPATH=. .venv/bin/python benchmarks/slurm_launch.py [--repeats 5]

A real Slurm on this machine (tests/slurmcluster.py: munged, slurmctld, two slurmd, nodes n1 and n2;
run as root, after scripts/setup installed slurm-wlm and munge). The benchmark runs itself again under
``salloc --nodes=2`` and, inside that allocation, starts the same trivial 2-rank script (one rank per
node, no torch) both ways:

- hgtrain: ``hgtrain launch --nproc-per-node 1 --plan PLAN -- python script``, the plan laid out in
  advance for the allocation's two nodes (so no probe or bench); each node's agent is a job step;
- srun: ``srun --nodes=2 --ntasks=2 --overlap python script``;
- for reference, hgtrain on the embedded local cluster (two ranks on the machine the launch runs on,
  local subprocesses, the allocation's variables unset): what the launch costs without Slurm, so the
  difference to the first row is the srun transport's own share.
start: from the command (just before its process is spawned) to every rank running, by the wall clock
each rank writes as its first statement; end: to the launcher's exit. Goal: hgtrain / srun <= 1.5 for
both. Prints a table, then one JSON object (``goals``: which goals were met).
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
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hgcli.config.cluster import load_node_source  # noqa: E402
from hgcli.plan.files import write_plan  # noqa: E402
from hgcli.schema.stages import GroupPlan, Plan, RankPlan, Role, Strategy  # noqa: E402
# The embedded cluster's two-rank plan of the launch benchmark (this script's directory is on sys.path).
from launch_latency import timed_launch, two_rank_plan  # noqa: E402

GOAL_RATIO = 1.5
# Each rank writes its clock to its own file; under srun the rank is SLURM_PROCID.
TRIVIAL = """import os, time
now = repr(time.time())
rank = os.environ.get('RANK', os.environ.get('SLURM_PROCID'))
open(os.path.join(os.environ['BENCH_OUT'], 'up-' + rank), 'w').write(now)
"""


def allocation_plan() -> Plan:
    """One emulated worker on each node of the allocation, for the cluster hgtrain sees in it."""
    cluster = load_node_source(nproc_per_node=1, transport="srun")
    ranks = tuple(RankPlan(rank=r, role=Role.WORKER, node=n.name, device="gpu0", group=0, batch_size=32,
                           local_rank=0, emulated=True) for r, n in enumerate(cluster.nodes))
    return Plan(strategy=Strategy.ALLREDUCE, world_size=len(ranks), groups=(GroupPlan(id=0, ranks=(0, 1)),),
                ranks=ranks, predicted_samples_per_s={}, global_batch=64, cluster=cluster.fingerprint(),
                reason="benchmark: one rank per node of the allocation, laid out in advance")


class Tools:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.plan = work / "plan.json"
        write_plan(self.plan, allocation_plan())
        self.local_plan = work / "local-plan.json"
        write_plan(self.local_plan, two_rank_plan())
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(work / "home"),
                    "HGTRAIN_STATE_DIR": str(work / "state")}
        (work / "home").mkdir(exist_ok=True)
        self.script = work / "trivial.py"
        self.script.write_text(TRIVIAL)

    def argv(self, tool: str, out: Path) -> tuple[list[str], dict[str, str]]:
        if tool == "hgtrain":
            return ([sys.executable, "-m", "hgcli", "launch", "--nproc-per-node", "1", "--plan", str(self.plan),
                     "--env", f"BENCH_OUT={out}", "--", sys.executable, str(self.script)], self.env)
        if tool == "hgtrain-local":
            outside = {k: v for k, v in self.env.items() if not k.startswith("SLURM_")}
            return ([sys.executable, "-m", "hgcli", "launch", "--plan", str(self.local_plan), "--env",
                     f"BENCH_OUT={out}", "--", sys.executable, str(self.script)], outside)
        return (["srun", "--nodes=2", "--ntasks=2", "--overlap", "--quiet", sys.executable, str(self.script)],
                {**self.env, "BENCH_OUT": str(out)})

    def start_and_end(self, tool: str) -> tuple[float, float]:
        out = self.work / f"out-{uuid.uuid4().hex[:8]}"
        out.mkdir()
        argv, env = self.argv(tool, out)
        return timed_launch(tool, argv, env, out)


def inside(repeats: int) -> dict[str, dict[str, float]]:
    """Run in the allocation: both tools, alternating, after one warm-up each."""
    with tempfile.TemporaryDirectory(prefix="hg-slurm-latency-") as tmp:
        tools = Tools(Path(tmp))
        runs: dict[str, list[tuple[float, float]]] = {"hgtrain": [], "srun": [], "hgtrain-local": []}
        for tool in runs:
            tools.start_and_end(tool)   # warm-up: page cache, .pyc files
        for _ in range(repeats):
            for tool in runs:
                runs[tool].append(tools.start_and_end(tool))
    return {tool: {"start_s": statistics.median(r[0] for r in found), "end_s": statistics.median(r[1] for r in found)}
            for tool, found in runs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)   # the run under salloc
    args = parser.parse_args()
    if args.inside:
        print(json.dumps(inside(args.repeats)))
        return 0
    from tests.slurmcluster import missing_programs, start_slurm

    missing = missing_programs()
    if missing or os.geteuid() != 0:
        print(f"slurm_launch: needs root and Slurm (missing: {', '.join(missing) or 'none'}); run scripts/setup "
              "as root", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hg-slurm-") as tmp:
        slurm = start_slurm(Path(tmp) / "slurm", nodes=2)
        try:
            done = subprocess.run(["salloc", "--nodes=2", "--quiet", "--", sys.executable, __file__, "--inside",
                                   "--repeats", str(args.repeats)], capture_output=True, text=True,
                                  env=slurm.env(), timeout=1800, stdin=subprocess.DEVNULL)
            version = slurm.command("srun", "--version").stdout.strip()
        finally:
            slurm.stop()
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-3000:], file=sys.stderr)
        return 1
    results = json.loads(done.stdout.strip().splitlines()[-1])
    h, s, local = results["hgtrain"], results["srun"], results["hgtrain-local"]
    figures = {
        "benchmark": "slurm_launch", "slurm": version, "repeats": args.repeats, "nodes": 2, "ranks": 2,
        "hgtrain_start_s": round(h["start_s"], 3), "srun_start_s": round(s["start_s"], 3),
        "start_ratio": round(h["start_s"] / s["start_s"], 3),
        "hgtrain_end_s": round(h["end_s"], 3), "srun_end_s": round(s["end_s"], 3),
        "end_ratio": round(h["end_s"] / s["end_s"], 3),
        "hgtrain_local_start_s": round(local["start_s"], 3), "hgtrain_local_end_s": round(local["end_s"], 3),
        "load_1min": round(os.getloadavg()[0], 2),
    }
    figures["goals"] = {f"start_ratio<={GOAL_RATIO}": figures["start_ratio"] <= GOAL_RATIO,
                        f"end_ratio<={GOAL_RATIO}": figures["end_ratio"] <= GOAL_RATIO}
    print(f"{version}, 2 nodes, 1 rank each; median of {args.repeats}")
    print(f"{'':<30}{'hgtrain':>10}{'srun':>10}{'ratio':>8}{'hgtrain local':>15}")
    print(f"{'command -> all ranks up (s)':<30}{h['start_s']:>10.3f}{s['start_s']:>10.3f}{figures['start_ratio']:>8.2f}"
          f"{local['start_s']:>15.3f}")
    print(f"{'command -> launcher exit (s)':<30}{h['end_s']:>10.3f}{s['end_s']:>10.3f}{figures['end_ratio']:>8.2f}"
          f"{local['end_s']:>15.3f}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
