"""Log throughput: one rank printing N lines (default 1,000,000) through a real sshd test host.

    PYTHONPATH=. python3 benchmarks/log_throughput.py [--lines 1000000] [--repeats 3]

- hgtrain: ``hgtrain launch`` (plain output to a pipe, as in CI) of one rank on the test host that
  writes lines ``"<i> <padding>"``; every line received on hgtrain's stdout is checked: none lost,
  none repeated, in order; its rank log file on the controller is checked the same way. The state
  directory is one a user would have after a first launch (it remembers where the package is on the
  node, as it does for every later launch).
- ssh python: ``ssh host env PYTHONUNBUFFERED=1 python printer.py``, the same rank run by hand over
  OpenSSH (what a user of pdsh or a hand-written ssh loop gets) as hgtrain and torchrun run a rank
  (unbuffered, so a line is out when it is printed); and both buffered: ``hgtrain launch --env
  PYTHONUNBUFFERED=`` against plain ``ssh host python printer.py``. Every line checked.
- ssh cat: ``ssh host cat FILE`` of exactly the bytes the rank printed (OpenSSH client, same host),
  every line checked too.
Rates are lines over the time from the command to the last line received. The host shares the 2
cores with the client (and, on a shared machine, with whatever else runs), so the three are measured
in turns, one right after the other, ``--repeats`` times: the results are medians of the turns'
ratios, and every turn is printed.

The goals:
- **streaming against ssh python >= 1**: the time to stream the lines with each command's fixed cost
  taken off (hgtrain: a launch of a rank that prints nothing, start-up and teardown; ssh: ``ssh host
  true``; medians of 3): hgtrain's log path must keep up with a bare ssh session running the rank;
- **against ssh cat >= 0.5**, whole commands, hgtrain's rank with Python's own buffering (``cat``
  makes no lines, so this bounds what the forwarding costs beyond the rank itself; an unbuffered
  rank spends ~0.8 s of CPU more itself writing 1,000,000 lines one syscall each, also printed).
Also printed: the printing rank alone, into a pipe on this machine (no forwarding can beat the rank
that makes the lines). Prints a table, then one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hgcli.schema.stages import Cluster, GroupPlan, Plan, RankPlan, Role, Strategy  # noqa: E402
from hgcli.plan.files import write_plan  # noqa: E402
from tests.launch.hg import cluster_toml  # noqa: E402
from tests.sshhosts import start_hosts  # noqa: E402

PAD = "x" * 40   # ~50-byte lines, a typical log line


def printer(lines: int) -> str:
    return (f"import sys\nw = sys.stdout.write\nfor i in range({lines}):\n    w(f'{{i}} {PAD}\\n')\n")


def check(lines: list[str], expected: int, prefix: str) -> tuple[int, bool]:
    """(lines received, all present in order) for lines ``<prefix><i> <PAD>``."""
    got = [line[len(prefix):] for line in lines if line.startswith(prefix) and line]
    ok = len(got) == expected and all(line == f"{i} {PAD}" for i, line in enumerate(got))
    return len(got), ok


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3, help="turns of (hgtrain, ssh python, ssh cat) runs")
    args = parser.parse_args()
    n = args.lines
    pairs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hg-logs-") as tmp_name:
        tmp = Path(tmp_name)
        hosts = start_hosts(tmp / "hosts", 1, first=61)
        try:
            node = hosts.nodes()[0]
            node = dataclasses.replace(node, python=sys.executable)
            cluster = Cluster(nodes=(node,), ssh=hosts.ssh_settings())
            ctoml = cluster_toml(tmp / "cluster.toml", cluster, known_hosts=str(hosts.known_hosts))
            plan = Plan(strategy=Strategy.ALLREDUCE, world_size=1, groups=(GroupPlan(id=0, ranks=(0,)),),
                        ranks=(RankPlan(rank=0, role=Role.WORKER, node=node.name, device="gpu0", group=0,
                                        batch_size=1, emulated=True),),
                        predicted_samples_per_s={}, global_batch=1, cluster=cluster.fingerprint())
            write_plan(tmp / "plan.json", plan)
            script = tmp / "printer.py"
            script.write_text(printer(n))
            state = tmp / "state"
            env = {"PYTHONPATH": str(REPO), "HOME": str(tmp), "HGTRAIN_STATE_DIR": str(state),
                   "PATH": "/usr/bin:/bin"}
            base = [sys.executable, "-m", "hgcli", "launch", "-c", str(ctoml), "--plan", str(tmp / "plan.json"),
                    "--", sys.executable, str(script)]
            empty = base[:-2] + [sys.executable, "-c", "pass"]
            subprocess.run(empty, env=env, check=True, capture_output=True, timeout=300)   # ships the package once
            empties = []
            for _ in range(3):
                t0 = time.perf_counter()
                subprocess.run(empty, env=env, check=True, capture_output=True, timeout=300)
                empties.append(time.perf_counter() - t0)
            empty_s = median(empties)
            t0 = time.perf_counter()
            alone = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=600, env=env)
            alone_s = time.perf_counter() - t0
            if alone.stdout.count(b"\n") != n:
                raise RuntimeError("the printing rank alone did not print every line")

            data = tmp / "lines.txt"
            data.write_text("".join(f"{i} {PAD}\n" for i in range(n)))
            config = tmp / "ssh_config"
            config.write_text(f"Host h\n  HostName {node.address}\n  Port {node.port}\n  User root\n"
                              f"  IdentityFile {hosts.client_key}\n  IdentitiesOnly yes\n"
                              f"  UserKnownHostsFile {hosts.known_hosts}\n  StrictHostKeyChecking yes\n"
                              "  BatchMode yes\n  LogLevel ERROR\n")
            for _ in range(args.repeats):
                before = set((state / "jobs").iterdir())
                t0 = time.perf_counter()
                done = subprocess.run(base, env=env, capture_output=True, timeout=1800)
                hg_s = time.perf_counter() - t0
                if done.returncode != 0:
                    raise RuntimeError(done.stderr.decode()[-2000:])
                hg_received, hg_ok = check(done.stdout.decode().split("\n"), n, f"{node.name}:0 | ")
                (job,) = set((state / "jobs").iterdir()) - before
                file_received, file_ok = check((job / "rank0.log").read_text().split("\n"), n, "")
                # The same rank by hand, as hgtrain (and torchrun) run it: unbuffered.
                t0 = time.perf_counter()
                by_hand = subprocess.run(["ssh", "-F", str(config), "h", "env", "PYTHONUNBUFFERED=1",
                                          sys.executable, str(script)], capture_output=True, timeout=600)
                ssh_py_s = time.perf_counter() - t0
                py_received, py_ok = check(by_hand.stdout.decode().split("\n"), n, "")
                # Both with Python's own block buffering: `--env PYTHONUNBUFFERED=` opts out.
                t0 = time.perf_counter()
                done_b = subprocess.run(base[:-3] + ["--env", "PYTHONUNBUFFERED="] + base[-3:], env=env,
                                        capture_output=True, timeout=1800)
                hg_b_s = time.perf_counter() - t0
                hg_b_received, hg_b_ok = check(done_b.stdout.decode().split("\n"), n, f"{node.name}:0 | ")
                t0 = time.perf_counter()
                by_hand_b = subprocess.run(["ssh", "-F", str(config), "h", sys.executable, str(script)],
                                           capture_output=True, timeout=600)
                ssh_py_b_s = time.perf_counter() - t0
                py_b_received, py_b_ok = check(by_hand_b.stdout.decode().split("\n"), n, "")
                t0 = time.perf_counter()
                cat = subprocess.run(["ssh", "-F", str(config), "h", "cat", str(data)], capture_output=True,
                                     timeout=600)
                cat_s = time.perf_counter() - t0
                cat_received, cat_ok = check(cat.stdout.decode().split("\n"), n, "")
                pairs.append({"hgtrain_s": round(hg_s, 3), "hgtrain_received": hg_received,
                              "hgtrain_in_order_none_lost": hg_ok,
                              "hgtrain_log_file_in_order_none_lost": file_ok and file_received == n,
                              "ssh_python_s": round(ssh_py_s, 3),
                              "ssh_python_in_order_none_lost": py_ok and py_received == n,
                              "hgtrain_buffered_s": round(hg_b_s, 3), "ssh_python_buffered_s": round(ssh_py_b_s, 3),
                              "buffered_in_order_none_lost": hg_b_ok and py_b_ok and hg_b_received == py_b_received == n,
                              "ssh_cat_s": round(cat_s, 3), "ssh_cat_in_order_none_lost": cat_ok and cat_received == n,
                              # against cat, the forwarding's cost: the rank with Python's own buffering
                              "ratio": round(cat_s / hg_b_s, 4), "ratio_unbuffered": round(cat_s / hg_s, 4)})
            trues = []
            for _ in range(3):
                t0 = time.perf_counter()
                subprocess.run(["ssh", "-F", str(config), "h", "true"], check=True, capture_output=True, timeout=60)
                trues.append(time.perf_counter() - t0)
            true_s = median(trues)
        finally:
            hosts.stop()
    hg_s = median([p["hgtrain_s"] for p in pairs])
    cat_s = median([p["ssh_cat_s"] for p in pairs])
    py_s = median([p["ssh_python_s"] for p in pairs])
    complete = all(p["hgtrain_in_order_none_lost"] and p["hgtrain_log_file_in_order_none_lost"]
                   and p["ssh_cat_in_order_none_lost"] and p["ssh_python_in_order_none_lost"]
                   and p["buffered_in_order_none_lost"] for p in pairs)
    for p in pairs:   # each turn's streaming ratio, the fixed costs (medians) taken off both
        hg_stream, py_stream = p["hgtrain_s"] - empty_s, p["ssh_python_s"] - true_s
        p["streaming_vs_ssh_python"] = round(py_stream / hg_stream, 4) if hg_stream > 0 else None
        hg_stream, py_stream = p["hgtrain_buffered_s"] - empty_s, p["ssh_python_buffered_s"] - true_s
        p["buffered_streaming_vs_ssh_python"] = round(py_stream / hg_stream, 4) if hg_stream > 0 else None
    streaming = [p["streaming_vs_ssh_python"] for p in pairs if p["streaming_vs_ssh_python"] is not None]
    buffered = [p["buffered_streaming_vs_ssh_python"] for p in pairs
                if p["buffered_streaming_vs_ssh_python"] is not None]
    figures = {
        "lines": n, "bytes": n * (len(PAD) + 2 + len(str(n // 2))), "repeats": len(pairs),
        "hgtrain_s": round(hg_s, 3), "hgtrain_lines_per_s": round(n / hg_s),
        "ssh_cat_s": round(cat_s, 3), "ssh_cat_lines_per_s": round(n / cat_s),
        "ssh_python_s": round(py_s, 3),
        "streaming_vs_ssh_python": round(median(streaming), 4) if streaming else None,
        "hgtrain_buffered_s": round(median([p["hgtrain_buffered_s"] for p in pairs]), 3),
        "ssh_python_buffered_s": round(median([p["ssh_python_buffered_s"] for p in pairs]), 3),
        "buffered_streaming_vs_ssh_python": round(median(buffered), 4) if buffered else None,
        "all_in_order_none_lost": complete,
        "ratio": round(median([p["ratio"] for p in pairs]), 4), "goal_ratio": 0.5,
        "pairs": pairs,
        "hgtrain_empty_job_s": round(empty_s, 3), "ssh_true_s": round(true_s, 3),
        # None when the run's fixed cost was measured longer than a whole run (a load spike)
        "hgtrain_streaming_lines_per_s": round(n / (hg_s - empty_s)) if hg_s > empty_s else None,
        "ssh_cat_streaming_lines_per_s": round(n / (cat_s - true_s)) if cat_s > true_s else None,
        "rank_alone_s": round(alone_s, 3), "rank_alone_lines_per_s": round(n / alone_s),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    streams = (figures["hgtrain_streaming_lines_per_s"], figures["ssh_cat_streaming_lines_per_s"])
    figures["streaming_ratio"] = round(streams[0] / streams[1], 4) if None not in streams else None
    figures["goals"] = {
        "streaming_vs_ssh_python": {"goal": ">= 1.0", "value": figures["streaming_vs_ssh_python"],
                                    "met": (figures["streaming_vs_ssh_python"] or 0) >= 1.0},
        "buffered_streaming_vs_ssh_python": {"goal": ">= 1.0", "value": figures["buffered_streaming_vs_ssh_python"],
                                             "met": (figures["buffered_streaming_vs_ssh_python"] or 0) >= 1.0},
        "ratio_vs_ssh_cat": {"goal": ">= 0.5", "value": figures["ratio"], "met": figures["ratio"] >= 0.5},
        "all_in_order_none_lost": {"goal": True, "value": complete, "met": complete},
    }
    figures["ok"] = all(g["met"] for g in figures["goals"].values())
    print("unbuffered: the rank as hgtrain and torchrun run it (PYTHONUNBUFFERED=1), by hand the same; "
          "buffered: hgtrain --env PYTHONUNBUFFERED= against plain 'ssh host python'")
    print(f"{'turn':<6}{'hgtrain s':>10}{'ssh py s':>10}{'stream':>8}{'hg buf s':>10}{'py buf s':>10}{'stream':>8}"
          f"{'ssh cat s':>10}{'vs cat':>8}  complete+ordered")
    for i, p in enumerate(pairs, 1):
        a, b = p["streaming_vs_ssh_python"], p["buffered_streaming_vs_ssh_python"]
        print(f"{i:<6}{p['hgtrain_s']:>10.2f}{p['ssh_python_s']:>10.2f}{a if a is not None else '-':>8}"
              f"{p['hgtrain_buffered_s']:>10.2f}{p['ssh_python_buffered_s']:>10.2f}{b if b is not None else '-':>8}"
              f"{p['ssh_cat_s']:>10.2f}{p['ratio']:>8.3f}  "
              f"{p['hgtrain_in_order_none_lost'] and p['hgtrain_log_file_in_order_none_lost']}, "
              f"{p['ssh_python_in_order_none_lost']}, {p['buffered_in_order_none_lost']}, {p['ssh_cat_in_order_none_lost']}")
    print(f"median: hgtrain {hg_s:.2f} s ({n / hg_s:,.0f} lines/s), buffered {figures['hgtrain_buffered_s']:.2f} s, "
          f"ssh cat {cat_s:.2f} s ({n / cat_s:,.0f} lines/s); ratio ssh-cat/hgtrain buffered {figures['ratio']:.3f} "
          f"(goal >= 0.5), unbuffered {median([p['ratio_unbuffered'] for p in pairs]):.3f}")
    print(f"fixed cost: hgtrain job printing nothing {empty_s:.2f} s, ssh host true {true_s:.2f} s; without it "
          f"{streams[0] or '-'} vs ssh cat's {streams[1] or '-'} lines/s; streaming against ssh python "
          f"{figures['streaming_vs_ssh_python'] or '-'} unbuffered, {figures['buffered_streaming_vs_ssh_python'] or '-'} "
          "buffered (goals >= 1.0)")
    print(f"the printing rank alone, into a pipe: {alone_s:.2f} s ({figures['rank_alone_lines_per_s']:,} lines/s); "
          f"load average {figures['load_average']}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
