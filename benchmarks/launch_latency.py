"""Launch latency and teardown: hgtrain on the embedded local cluster vs torchrun, same script, same run.

    PYTHONPATH=. python3 benchmarks/launch_latency.py [--repeats 5]

- start: from the command (just before the process is spawned) to every rank running, measured by
  the wall clock each rank prints as its first statement; end: to the launcher's exit. The ranks
  run a trivial 2-rank script (no torch). hgtrain uses ``--plan`` prepared in advance for the
  embedded local cluster (so no probe/bench); torchrun is ``torchrun --nproc-per-node 2``.
  Goal: hgtrain / torchrun <= 1.3 for both.
- teardown: rank 1 exits 1 while rank 0 sleeps; from rank 1's last printed clock to the moment no
  rank process is left (polled in /proc by a marker in the ranks' environment). Goal <= 3 s.
Agents and state use a temporary HOME and state directory. Prints a table, then one JSON object.
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

from hgcli.config.cluster import default_cluster  # noqa: E402
from hgcli.schema.stages import GroupPlan, Plan, RankPlan, Role, Strategy  # noqa: E402
from hgcli.plan.files import write_plan  # noqa: E402

# Each rank writes its clock to its own file (two ranks sharing a stdout interleave their bytes).
TRIVIAL = """import os, time
now = repr(time.time())
open(os.path.join(os.environ['BENCH_OUT'], 'up-' + os.environ['RANK']), 'w').write(now)
"""
FAILING = TRIVIAL + """import sys
if os.environ['RANK'] == '1':
    time.sleep(1.0)
    open(os.path.join(os.environ['BENCH_OUT'], 'dying'), 'w').write(repr(time.time()))
    sys.exit(1)
time.sleep(120)
"""


def timed_launch(tool: str, argv: list[str], env: dict[str, str], out: Path) -> tuple[float, float]:
    """Run ``argv``; seconds until both ranks wrote their ``up-*`` stamp in ``out``, and until it exited."""
    t0 = time.time()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    t_end = time.time()
    ups = {p.name: float(p.read_text()) for p in out.glob("up-*")}
    if done.returncode != 0 or len(ups) != 2:
        raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stdout[-500:]} {done.stderr[-1500:]}")
    return max(ups.values()) - t0, t_end - t0


def two_rank_plan() -> Plan:
    cluster = default_cluster()
    ranks = tuple(RankPlan(rank=r, role=Role.WORKER, node="local", device=f"gpu{r}", group=0, batch_size=32,
                           local_rank=r, emulated=True) for r in range(2))
    return Plan(strategy=Strategy.ALLREDUCE, world_size=2, groups=(GroupPlan(id=0, ranks=(0, 1)),), ranks=ranks,
                predicted_samples_per_s={}, global_batch=64, cluster=cluster.fingerprint(),
                reason="benchmark: two ranks laid out in advance")


def marked_ranks(marker: str) -> list[int]:
    """Live rank processes (RANK set) carrying BENCH_MARK=<marker> in their environment."""
    found = []
    want = f"BENCH_MARK={marker}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if want in env and any(e.startswith(b"RANK=") for e in env) and state not in "ZX":
            found.append(int(name))
    return found


class Tools:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.plan = work / "plan.json"
        write_plan(self.plan, two_rank_plan())
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(work / "home"),
                    "HGTRAIN_STATE_DIR": str(work / "state")}
        (work / "home").mkdir(exist_ok=True)

    def script(self, text: str) -> Path:
        path = self.work / f"script-{uuid.uuid4().hex[:8]}.py"
        path.write_text(text)
        return path

    def argv(self, tool: str, script: Path, marker: str, out: Path) -> tuple[list[str], dict[str, str]]:
        if tool == "hgtrain":
            return ([sys.executable, "-m", "hgcli", "launch", "--plan", str(self.plan), "--grace", "5",
                     "--env", f"BENCH_MARK={marker}", "--env", f"BENCH_OUT={out}", "--", sys.executable,
                     str(script)], self.env)
        return ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                {**self.env, "BENCH_MARK": marker, "BENCH_OUT": str(out), "OMP_NUM_THREADS": "1"})

    def out_dir(self) -> Path:
        path = self.work / f"out-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return path

    def start_and_end(self, tool: str) -> tuple[float, float]:
        script, out = self.script(TRIVIAL), self.out_dir()
        argv, env = self.argv(tool, script, uuid.uuid4().hex, out)
        return timed_launch(tool, argv, env, out)

    def teardown(self, tool: str) -> tuple[float, int]:
        script, out = self.script(FAILING), self.out_dir()
        marker = uuid.uuid4().hex
        argv, env = self.argv(tool, script, marker, out)
        dying = out / "dying"
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        gone = None
        deadline = time.time() + 120
        while time.time() < deadline:
            if dying.exists() and dying.stat().st_size and not marked_ranks(marker):
                gone = time.time()
                break
            time.sleep(0.01)
        code = proc.wait(120)
        if gone is None:
            raise RuntimeError(f"{tool}: teardown not observed")
        return gone - float(dying.read_text()), code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hg-latency-") as tmp:
        tools = Tools(Path(tmp))
        results: dict[str, dict[str, float]] = {}
        for tool in ("hgtrain", "torchrun"):
            tools.start_and_end(tool)   # warm-up: page cache, .pyc files
            starts, ends = [], []
            for _ in range(args.repeats):
                s, e = tools.start_and_end(tool)
                starts.append(s)
                ends.append(e)
            downs = [tools.teardown(tool) for _ in range(max(1, args.repeats // 2))]
            results[tool] = {"start_s": statistics.median(starts), "end_s": statistics.median(ends),
                             "teardown_s": statistics.median(d[0] for d in downs),
                             "teardown_exit_code": downs[0][1]}
    h, t = results["hgtrain"], results["torchrun"]
    figures = {
        "repeats": args.repeats,
        "hgtrain_start_s": round(h["start_s"], 3), "torchrun_start_s": round(t["start_s"], 3),
        "start_ratio": round(h["start_s"] / t["start_s"], 3),
        "hgtrain_end_s": round(h["end_s"], 3), "torchrun_end_s": round(t["end_s"], 3),
        "end_ratio": round(h["end_s"] / t["end_s"], 3),
        "hgtrain_teardown_s": round(h["teardown_s"], 3), "torchrun_teardown_s": round(t["teardown_s"], 3),
        "hgtrain_teardown_exit_code": h["teardown_exit_code"], "torchrun_teardown_exit_code": t["teardown_exit_code"],
        "goal_ratio": 1.3, "goal_teardown_s": 3.0,
    }
    figures["start_ok"] = figures["start_ratio"] <= 1.3
    figures["end_ok"] = figures["end_ratio"] <= 1.3
    figures["teardown_ok"] = figures["hgtrain_teardown_s"] <= 3.0
    print(f"{'median of ' + str(args.repeats):<28}{'hgtrain':>10}{'torchrun':>10}{'ratio':>8}")
    print(f"{'command -> all ranks up (s)':<28}{h['start_s']:>10.3f}{t['start_s']:>10.3f}{figures['start_ratio']:>8.2f}")
    print(f"{'command -> launcher exit (s)':<28}{h['end_s']:>10.3f}{t['end_s']:>10.3f}{figures['end_ratio']:>8.2f}")
    print(f"{'rank fails -> last rank gone':<28}{h['teardown_s']:>10.3f}{t['teardown_s']:>10.3f}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
